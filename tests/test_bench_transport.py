"""``mstar bench transport`` at test sizes: every path and baseline measured, payloads checked end to
end (the bench raises on a changed payload), the table and the size parser."""

import pytest

from mstar.bench import transport_bench
from mstar.bench.transport_bench import PATHS, format_table, parse_sizes, run_transport_bench
from mstar.cli.main import main


@pytest.mark.slow
def test_every_path_moves_small_and_shm_sized_tensors(monkeypatch):
    monkeypatch.setattr(transport_bench, "BUDGET_S", 0.02)
    rows = run_transport_bench([4096, 2 << 20], PATHS)
    assert [r.size for r in rows] == [4096, 2 << 20]
    for r in rows:
        assert set(r.seconds) == {"memcpy", "socket", "socket-new", "zmq", *PATHS}
        assert all(s > 0 for s in r.seconds.values())
    table = format_table(rows)
    assert "| 2 MB |" in table and "shm/memcpy" in table and "tcp/socket" in table and "tcp/zmq" in table


def test_sizes_parse_and_bad_arguments_are_refused(capsys):
    assert parse_sizes("4K, 1M,65536") == [4096, 1 << 20, 65536]
    for bad in ("", "4G", "0", "-1K", "abc", "2048M"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_sizes(bad)
    assert main(["bench", "transport", "--paths", "rdma"]) == 2
    assert "--paths takes some of inline, ipc, shm, tcp" in capsys.readouterr().err

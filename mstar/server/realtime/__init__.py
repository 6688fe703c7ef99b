"""``WS /v1/realtime``: a subset of OpenAI's Realtime API (GA event names) over the served model.

``events`` parses and checks client events and builds server events; ``session`` is one
connection's conversation and the response under way. The route itself is
``mstar.server.routes.realtime``.
"""

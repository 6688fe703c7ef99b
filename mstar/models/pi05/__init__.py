"""pi0.5, the vision-language-action policy of Physical Intelligence, in lerobot's checkpoint layout."""

"""Which message classes may cross process boundaries: the registry is ``mstar.model.sendable`` (a
family registers its typed request there, below the runtime); the wire reads it from here."""

from mstar.model.sendable import (
    _CLS_TO_TAG,
    _DC_FIELDS,
    _TAG_TO_CLS,
    is_registered,
    message_tag,
    register_message,
)

__all__ = ["_CLS_TO_TAG", "_DC_FIELDS", "_TAG_TO_CLS", "is_registered", "message_tag", "register_message"]

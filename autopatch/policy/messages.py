"""What a policy's error says: the file, the line and the key, and never a whole value (a
value may be huge, nested or cyclic, and it lands in a log)."""

import reprlib

SHOWN = 80                 # characters of a value an error message echoes


class PolicyError(ValueError):
    """An invalid policy: the message names the file, the line and the key."""


def shown(value):
    """``repr(value)`` cut to ``SHOWN`` characters: an error message never echoes a whole value
    (reprlib stops early inside long or deeply nested ones, and at cycles)."""
    try:
        text = _REPR.repr(value)
    except ValueError:        # an int past Python's digit limit for str()
        text = f"<an int of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN, SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def cut(text):
    """A key or name as given, cut to ``SHOWN`` characters for a message."""
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def cut_message(error):
    """A check's message, cut to a few hundred characters (checks echo values through ``shown``;
    this bounds any that do not)."""
    text = str(error)
    return text if len(text) <= 4 * SHOWN else text[:4 * SHOWN - 3] + "..."

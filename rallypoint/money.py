"""Money as integers: minor units at a scale, never floats.

A budget has a ``scale`` (decimal places of its currency's major unit): at scale 2,
250 minor units are 2.50. Amounts cross the wire and live in the coordinator as
integers of minor units; these two functions convert to and from decimal strings with
integer arithmetic only.
"""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import ValidationError

__all__ = ["minor_units", "format_minor"]

_DECIMAL_RE = re.compile(r"^([0-9]+)(?:\.([0-9]+))?$")


def minor_units(amount: "str | int | Decimal", scale: int) -> int:
    """``"5.00"`` at scale 2 -> ``500``. ``amount``: a decimal string of the major unit
    (digits, optionally a dot and more digits: no sign, exponent or separators), a
    ``Decimal``, or an ``int`` of major units. Trailing fractional zeros are ignored;
    more fractional digits than ``scale`` is VALIDATION_FAILED (it would round).
    Floats are refused: they cannot hold most decimal amounts exactly."""
    if isinstance(scale, bool) or not isinstance(scale, int) or not 0 <= scale <= 9:
        raise ValidationError(f"scale must be an integer from 0 to 9 (got {scale!r})", details={"field": "scale"})
    if isinstance(amount, bool) or isinstance(amount, float):
        raise ValidationError(
            f"amount must be a decimal string such as '5.00', a Decimal or an int, never a float (got {amount!r})",
            details={"field": "amount"},
        )
    if isinstance(amount, int):
        if amount < 0:
            raise ValidationError(f"amount must not be negative (got {amount})", details={"field": "amount"})
        return amount * 10**scale
    if isinstance(amount, Decimal):
        amount = format(amount, "f")
    if not isinstance(amount, str):
        raise ValidationError(f"amount must be a decimal string (got {amount!r})", details={"field": "amount"})
    m = _DECIMAL_RE.match(amount.strip())
    if m is None:
        raise ValidationError(f"amount must be digits with an optional decimal part, such as '5.00' (got {amount!r})",
                              details={"field": "amount"})
    whole, frac = m.group(1), (m.group(2) or "").rstrip("0")
    if len(frac) > scale:
        raise ValidationError(f"amount {amount!r} has more than {scale} decimal places (the budget's scale)",
                              details={"field": "amount"})
    return int(whole) * 10**scale + (int(frac.ljust(scale, "0")) if scale else 0)


def format_minor(amount: int, scale: int) -> str:
    """``500`` minor units at scale 2 -> ``"5.00"`` (integer arithmetic only)."""
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if scale == 0:
        return f"{sign}{amount}"
    whole, frac = divmod(amount, 10**scale)
    return f"{sign}{whole}.{frac:0{scale}d}"

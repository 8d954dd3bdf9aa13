"""Weight-update sessions, as SGLang 0.5.23's `SchedulerWeightUpdaterManager` keeps them.

`sglang/srt/managers/scheduler_components/weight_updater.py`: `/begin_weight_update` opens a
session (400 if one is open), `/end_weight_update` closes it (400 if none is open);
`/update_weights_from_distributed` and `/update_weights_from_tensor` outside a session answer 400
with the messages below -- the distributed one before joining any broadcast, so a trainer that
forgot to begin is told at once instead of hanging in its broadcast. `/update_weights_from_disk`
needs no session. `selector` picks the runners ("target", "draft", "all"); this server has no
draft model, so "draft" selects nothing (SGLang's `_select_runners` with no draft worker).

Only the HTTP rank (TP rank 0) keeps this state: every weight op reaches the other TP ranks
through rank 0, after this gate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SELECTORS = ("target", "draft", "all")

OUTSIDE_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"


class SessionError(ValueError):
    """A session rule was broken; the message is SGLang's."""


def check_selector(selector: object) -> str:
    """SGLang validates `selector` as Literal["target", "draft", "all"] when parsing the request."""
    if selector is None:
        return "all"
    if selector not in SELECTORS:
        raise SessionError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
    return str(selector)


def applies_to_target(selector: str) -> bool:
    """Whether an op with this selector loads into the served (target) model."""
    return selector in ("target", "all")


@dataclass
class Session:
    selector: str
    loaded_weights: bool = False


class SessionGate:
    """begin / end / require, with SGLang's 400 messages."""

    def __init__(self) -> None:
        self.session: Optional[Session] = None
        self.opened = 0     # sessions opened so far (get_model_info reports it)

    def begin(self, selector: object = None) -> str:
        sel = check_selector(selector)
        if self.session is not None:
            raise SessionError(ALREADY_OPEN)
        self.session = Session(selector=sel)
        self.opened += 1
        return "Success"

    def end(self) -> str:
        if self.session is None:
            raise SessionError(NOT_OPEN)
        self.session = None
        return "Success"

    def require(self, op: str) -> Session:
        """The open session, or SessionError naming `op` (e.g. "update_weights_from_tensor")."""
        if self.session is None:
            raise SessionError(OUTSIDE_SESSION.format(op=op))
        return self.session

    def loaded(self) -> None:
        if self.session is not None:
            self.session.loaded_weights = True

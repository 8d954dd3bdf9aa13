"""Weight versions: what the trainer calls a version, and which version produced each token.

The trainer pushes version ``n`` (``n`` optimizer steps applied) under the tag ``version_tag(n)``
(``"init"`` for 0, ``"step<n>"`` after), sent as SGLang's ``weight_version`` field; a server
reports the tag back in every ``/generate`` answer.

Which version produced which token: SGLang 0.5.23 answers ``meta_info.weight_versions``, a list
of ``{"version", "start", "end"}`` spans over the output tokens, whenever the weights changed while
a request was held by the scheduler (paused in place or retracted, then continued;
``sglang/srt/utils/weight_versions.py``). The embedded server answers the same spans, computed
here with SGLang's rule (``weight_version_spans``). A request that was aborted and resubmitted by
the client is two answers, each with its own spans; ``token_versions`` turns one answer into one
tag per output token.
"""
from __future__ import annotations

from typing import Any, Sequence

INIT_TAG = "init"


def version_tag(n: int) -> str:
    """The ``weight_version`` string of version ``n`` (optimizer steps applied)."""
    if n < 0:
        raise ValueError(f"weight versions start at 0, got {n}")
    return INIT_TAG if n == 0 else f"step{n}"


def version_number(tag: str) -> int:
    """Inverse of :func:`version_tag`. A server that never received megarl's weights answers its
    own default tag: that is an error here (its tokens belong to no trainer version)."""
    if tag == INIT_TAG:
        return 0
    if isinstance(tag, str) and tag.startswith("step") and tag[4:].isdigit():
        return int(tag[4:])
    raise ValueError(f"weight_version {tag!r} is not a megarl version tag ('init' or 'step<n>'): the server did "
                     f"not get its weights from this run")


def weight_version_spans(events: Sequence[tuple[str, int]], current: str, num_output_tokens: int) -> list[dict]:
    """SGLang's ``compute_weight_version_spans`` followed by ``add_weight_versions_to_meta_info``:
    ``events`` are ``(old_version, tokens generated when the weights changed)`` in order; the
    tokens after the last event belong to ``current``."""
    changes = [(v, n) for v, n in events] + [(current, num_output_tokens)]
    spans: list[dict] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return [s for s in spans if s["start"] < num_output_tokens or s["start"] == 0]


def token_versions(meta_info: dict[str, Any], num_tokens: int) -> list[str]:
    """One version tag per output token of one ``/generate`` answer (spans when the answer has
    them, else its single ``weight_version``)."""
    spans = meta_info.get("weight_versions")
    if spans:
        out: list[str] = []
        for span in spans:
            out.extend([str(span["version"])] * (int(span["end"]) - int(span["start"])))
        if len(out) != num_tokens:
            raise ValueError(f"weight_versions spans cover {len(out)} tokens, the answer has {num_tokens}")
        return out
    tag = meta_info.get("weight_version")
    if tag is None:
        raise ValueError("the /generate answer has no meta_info.weight_version")
    return [str(tag)] * num_tokens

"""A generative judge's prompt template: what the run spec checks at submit and the scorer replica renders.

A template is text with up to three placeholders, `{prompt}`, `{response}` and `{reference}`, each replaced by
that item's text; nothing else in it is read (no format specs, no attribute access: `str.format` would let a
template reach `{prompt.__class__}`). Other braces are kept as written, so a rubric may show JSON. A
placeholder-like name that is not one of the three (`{answer}`) is refused rather than left in the text, since
it is almost certainly a typo the judge would then read literally.

Torch-free: the coordinator (run spec, scorer identity) and the rollout's scorer role share this one definition.
"""
from __future__ import annotations

import hashlib
import re

PLACEHOLDERS = ("prompt", "response", "reference")
MAX_TEMPLATE_CHARS = 32768
_NAMED = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def check_template(template: str) -> str:
    """`template` if it renders; ValueError naming what is wrong (no {response}, an unknown placeholder)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"longer than {MAX_TEMPLATE_CHARS} characters")
    unknown = sorted({m.group(1) for m in _NAMED.finditer(template)} - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; a template may use "
                         f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if "{response}" not in template:
        raise ValueError("must contain {response}: a judge that never reads the response scores nothing")
    return template


def render_template(template: str, *, prompt: str, response: str, reference: str) -> str:
    """The template with each placeholder replaced, in one pass (a response containing "{reference}" stays
    as written: replaced text is never read again)."""
    values = {"prompt": prompt, "response": response, "reference": reference}
    return _NAMED.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def template_sha256(template: str) -> str:
    """The template's identity in step records and fingerprints."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()

"""Prompt workloads on the demo's held-out files (``assets/demo/heldout.json``: each file's opening text, so no
standard library is needed at run time). Used by scripts and tools only.

- ``first_line_prompts``: the acceptance evaluation's prompts, the first tokens of each held-out file.
- ``edit_prompts``: an editing workload. Each prompt quotes a top-level function of a held-out file and asks, as
  a code comment, for it back with a parameter renamed, then opens the changed ``def`` line (a code-continuation
  prompt: the demo target is a base model). The right answer repeats the quoted body with one name changed, the
  case where drafts that copy the context shine; how much a model does copy, :func:`repeat_fraction` measures
  (the small demo target copies little: docs/demo_pair.md).
"""
from __future__ import annotations

import ast
import itertools
import re

from ..demo import ASSETS
from ..tokenizer import load_tokenizer
from .acceptance_eval import heldout_texts, prompt_ids

EDIT_REQUEST = "# The same function, with the parameter {old} renamed to {new}:\n"


def first_line_prompts(n: int, prompt_tokens: int = 64, tokenizer=None) -> list[list[int]]:
    """The first ``prompt_tokens`` token ids of the first ``n`` held-out files that have that many (the prompts
    of ``scripts/eval_acceptance.py``); ``tokenizer`` defaults to the demo target's."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ASSETS / "target")
    return prompt_ids(tokenizer, heldout_texts(), n, prompt_tokens)


def edit_prompts(n: int, max_chars: int = 1000) -> list[str]:
    """``n`` edit prompts of at most ``max_chars`` characters, one function per held-out file in turn (file
    order, then the file's next function): the function's source, two blank lines, the request comment, and the
    function's ``def`` line with the parameter renamed (no newline after its colon: the model writes the line
    break and the body's indentation as one token, as in its training text). Raises if the held-out text holds
    fewer functions."""
    per_file = [[p for p in map(_edit_prompt, quoted_functions(text)) if p and len(p) <= max_chars]
                for text in heldout_texts()]
    prompts = [p for group in itertools.zip_longest(*per_file) for p in group if p is not None]
    if len(prompts) < n:
        raise ValueError(f"the held-out text holds {len(prompts)} functions that fit {max_chars} characters, "
                         f"not {n}")
    return prompts[:n]


def quoted_functions(text: str) -> list[str]:
    """The source of each complete top-level function (decorators included) of a file's opening ``text``, which
    may be cut anywhere: the longest prefix of whole lines that parses is read, and a function counts only if the
    next line of code after it stands at column 0 (else its body may go on past what parsed)."""
    lines = text.split("\n")
    for end in range(len(lines) - 1, 0, -1):  # the last line may be cut mid-way
        try:
            tree = ast.parse("\n".join(lines[:end]))
            break
        except SyntaxError:
            continue
    else:
        return []
    return ["\n".join(lines[_first_line(node) - 1:node.end_lineno]) for node in tree.body
            if isinstance(node, ast.FunctionDef) and _followed_by_top_level_code(lines, node.end_lineno)]


def _followed_by_top_level_code(lines: list[str], end_lineno: int) -> bool:
    """Whether the first line of code after line ``end_lineno`` (blanks and comments skipped: they may stand
    inside an indented body) starts at column 0."""
    following = next((line for line in lines[end_lineno:] if line.strip() and not line.lstrip().startswith("#")), "")
    return bool(following) and not following[0].isspace()


def _first_line(node: ast.FunctionDef) -> int:
    """1-based line of the function's first decorator, else of its ``def``."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _edit_prompt(source: str) -> str | None:
    """The edit prompt for one function's ``source``, or None when it has no parameter worth renaming (one used
    in the body, ``self`` and ``cls`` aside) or its body starts on the ``def`` line."""
    node = ast.parse(source).body[0]
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    old = next((name for name in names if name in used and name not in ("self", "cls")), None)
    if old is None or node.body[0].lineno == node.lineno:
        return None
    signature = "\n".join(source.split("\n")[node.lineno - 1:node.body[0].lineno - 1])
    if not signature.endswith(":"):
        return None  # a comment follows the signature: no clean def line to open
    new = f"new_{old}"
    head, paren, params = signature.partition("(")
    changed = head + paren + re.sub(rf"\b{re.escape(old)}\b", new, params)
    return f"{source}\n\n\n{EDIT_REQUEST.format(old=old, new=new)}{changed}"


def repeat_fraction(prompt: list[int], generated: list[int], min_match: int = 4, prompt_only: bool = False
                    ) -> float:
    """The fraction of ``generated`` tokens that extend a suffix match of at least ``min_match`` tokens: the
    ``min_match``-gram ending at the token occurred earlier in prompt + generated text (what a prompt-lookup or
    draft model copying the context would have proposed); with ``prompt_only``, in the prompt (copied from it,
    not the output repeating itself)."""
    tokens = list(prompt) + list(generated)
    seen = {tuple(tokens[i:i + min_match]) for i in range(len(prompt) - min_match + 1)}
    hits = 0
    for t in range(len(prompt), len(tokens)):
        gram = tuple(tokens[t - min_match + 1:t + 1])
        hits += t + 1 >= min_match and gram in seen
        if not prompt_only:
            seen.add(gram)
    return hits / max(1, len(generated))

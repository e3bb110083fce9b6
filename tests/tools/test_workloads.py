"""The prompt workloads on the demo's held-out files: first-line prompts (the acceptance evaluation's) and edit
prompts that quote a function and open its changed def line."""
import ast

import pytest

from tllm_spec.demo import ASSETS, is_trained
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.acceptance_eval import heldout_texts, prompt_ids
from tllm_spec.tools.workloads import EDIT_REQUEST, edit_prompts, first_line_prompts, quoted_functions, repeat_fraction

pytestmark = pytest.mark.skipif(not is_trained(), reason=f"no demo assets in {ASSETS}")


def split_edit_prompt(prompt: str) -> tuple[str, str, str]:
    """(quoted function, request comment, changed def line)."""
    quoted, _, rest = prompt.partition("\n\n\n# ")
    request, _, changed = rest.partition("\n")
    return quoted, "# " + request + "\n", changed


def test_first_line_prompts_are_the_acceptance_evaluations():
    tokenizer = load_tokenizer(ASSETS / "target")
    prompts = first_line_prompts(5, 64)
    assert prompts == prompt_ids(tokenizer, heldout_texts(), 5, 64)
    assert [len(p) for p in prompts] == [64] * 5
    assert heldout_texts()[0].startswith(tokenizer.decode(prompts[0]))


def test_edit_prompts_are_deterministic_and_fit_the_limit():
    prompts = edit_prompts(12, max_chars=600)
    assert prompts == edit_prompts(12, max_chars=600)
    assert len(set(prompts)) == 12 and all(0 < len(p) <= 600 for p in prompts)
    assert edit_prompts(12) != prompts  # the default allows longer functions, taken in their place


def test_an_edit_prompt_quotes_a_function_and_ends_with_its_changed_def_line():
    for prompt in edit_prompts(8):
        quoted, request, changed = split_edit_prompt(prompt)
        function = ast.parse(quoted).body[0]
        assert isinstance(function, ast.FunctionDef) and any(quoted in text for text in heldout_texts())
        old = request.split(" renamed to ")[0].rsplit(" ", 1)[1]
        assert request == EDIT_REQUEST.format(old=old, new=f"new_{old}")
        args = function.args
        assert old in {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        signature = "\n".join(quoted.split("\n")[function.lineno - 1:function.body[0].lineno - 1])
        assert prompt.endswith(changed) and changed.endswith(":") and f"new_{old}" in changed
        assert changed.replace(f"new_{old}", old) == signature and changed.startswith(f"def {function.name}(")


def test_quoted_functions_keep_decorators_and_skip_functions_the_cut_may_shorten():
    text = ("import os\n\n@cache\ndef first(a):\n    return a\n\n\ndef second(b):\n    return b\n\n\n"
            "def third(c):\n    return c + ")
    assert quoted_functions(text) == ["@cache\ndef first(a):\n    return a", "def second(b):\n    return b"]
    # cut inside a string: what parses ends before it, and the body goes on (a column-0 line inside the string)
    assert quoted_functions('def f(a):\n    x = a\n    y = """\nraw text\n') == []
    assert quoted_functions("def f(a):\n    return a\n# a comment\n    # another\n") == []  # no code follows


def test_too_many_edit_prompts_is_an_error():
    with pytest.raises(ValueError, match="functions that fit"):
        edit_prompts(10_000)


def test_repeat_fraction_counts_tokens_that_extend_a_four_token_match():
    prompt = [1, 2, 3, 4, 5, 6]
    # the generated 4 and 5 complete 4-grams of the prompt (1 2 3 4, 2 3 4 5); 1, 2, 3 and 9 do not
    assert repeat_fraction(prompt, [1, 2, 3, 4, 5, 9]) == pytest.approx(2 / 6)
    assert repeat_fraction(prompt, [7, 8, 9, 7, 8, 9, 7]) == pytest.approx(1 / 7)  # its own text counts too
    assert repeat_fraction(prompt, [7, 8, 9, 7, 8, 9, 7], prompt_only=True) == 0.0  # ... unless prompt_only
    assert repeat_fraction(prompt, [1, 2, 3, 4, 5, 9], prompt_only=True) == pytest.approx(2 / 6)
    assert repeat_fraction(prompt, []) == 0.0

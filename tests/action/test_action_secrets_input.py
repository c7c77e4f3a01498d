"""The action's `secrets:` input (issue 35): inline YAML only, values only from the step's env (never pasted
into the YAML, never from the checkout), never a variable the VM gets, and no error shows a value."""

from __future__ import annotations

import pytest

from action.inputs import read_inputs
from runner.errors import UserError

VALUE = "npm_Tok3n-value-0123456789"
GOOD = "npm:\n  env: NPM_TOKEN\n  host: npm.internal.example\n  paths: ['/*']\n  value-from: NPM_VALUE\n"


def inputs(secrets: str, **env: str) -> object:
    return read_inputs({"INPUT_RUN": "npm ci", "INPUT_SECRETS": secrets, "NPM_VALUE": VALUE, **env})


def test_a_binding_takes_its_value_from_the_steps_env_and_never_shows_it() -> None:
    (secret,) = inputs(GOOD).secrets  # type: ignore[attr-defined]
    assert (secret.name, secret.env, secret.host, secret.paths, secret.value) == (
        "npm", "NPM_TOKEN", "npm.internal.example", ("/*",), VALUE)
    assert VALUE not in repr(inputs(GOOD))


@pytest.mark.parametrize(("text", "env", "message"), [
    ("policy.yml", {}, "must be inline YAML"),
    (GOOD.replace("value-from: NPM_VALUE", f"value: {VALUE}"), {}, "give value-from"),
    (GOOD.replace("NPM_VALUE", "UNSET_VALUE"), {}, "UNSET_VALUE is empty or not set"),
    (GOOD, {"INPUT_ENV": "NPM_VALUE"}, "would put the value itself into the VM"),
    (GOOD.replace("env: NPM_TOKEN", "env: 'A B'"), {}, "secrets.npm.env"),
    (GOOD + "other: *x\n", {}, "not valid YAML"),
])
def test_a_bad_input_is_refused_with_why(text: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message) as refused:
        inputs(text, **env)
    assert VALUE not in str(refused.value)

"""A tool of your own, the worked example of `rollout.tools` (README "Your own tools").

A tool is a plain Python function (or an `async def` one) with a type hint on each argument and a
docstring whose Args: section describes them: the trainer builds its JSON schema from both
(transformers.utils.get_json_schema), the chat template lists it for the model, and a call the
model writes is checked against it before the function runs. Return a string, or anything JSON
can write; raise (or return text starting with "error") to refuse. The model's arguments are
untrusted text made into JSON values: never `eval` them, never pass them to a shell.

GSM8K with two tools, the built-in calculator and this one:

    python train.py --config configs/gsm8k_tool.yaml \\
        --set "rollout.tools=[task.tools:calculator,examples/math_tools.py:percent_of]"
"""


def percent_of(percent: float, value: float) -> float:
    """Compute a percentage of a value, for example 15 percent of 80 is 12.

    Args:
        percent: The percentage, for example 15 for 15%.
        value: The value it is a percentage of.
    """
    if abs(percent) > 1e6 or abs(value) > 1e12:
        raise ValueError("numbers this large are not in a school problem")
    return round(percent * value / 100, 6)

"""The errors of a session's operations, by whose they are to fix: the API answers each with its category."""


class UserError(ValueError):
    """Bad input from the client (a datum's shape, a token outside the vocabulary, an unknown loss, a context
    longer than the model's): answered with category ``user``, and the session goes on. The message names the
    datum (its index in the request) and the field."""


def datum_error(index: int, field: str, problem: str) -> UserError:
    """A :class:`UserError` naming datum ``index`` and its ``field``: ``data[3].loss_fn_inputs.weights: ...``."""
    return UserError(f"data[{index}].{field}: {problem}")

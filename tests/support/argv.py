"""Command lines for the CLI tests."""


def with_options(args: list, options: dict) -> list:
    """``args`` with each ``--option`` of ``options`` set to its value: replaced where given, else added."""
    args = list(args)
    for key, value in options.items():
        if key in args:
            args[args.index(key) + 1] = value
        else:
            args += [key, value]
    return args

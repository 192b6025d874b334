"""The one exception type the command line reports as a single line instead of a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, paths, data), explained in one line."""

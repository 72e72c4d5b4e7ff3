"""Imports every mechanism module so that its @register decorator runs. One line per file."""

from . import primal, softmax  # noqa: F401
from . import linear  # noqa: F401
from . import performer  # noqa: F401
from . import cosformer  # noqa: F401
from . import flowformer  # noqa: F401
from . import kerformer  # noqa: F401
from . import kernel  # noqa: F401
from . import svr  # noqa: F401
from . import nystrom  # noqa: F401
from . import linformer  # noqa: F401
from . import reformer  # noqa: F401

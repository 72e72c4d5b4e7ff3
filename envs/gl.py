"""Which OpenGL backend MuJoCo uses (``MUJOCO_GL``), checked before any simulator is built.

MuJoCo reads ``MUJOCO_GL`` when it is first imported: a value it does not accept, or a backend whose
library is missing (``osmesa`` without OSMesa), makes ``import mujoco`` fail, so every simulator fails
to load with a traceback deep inside MuJoCo (in a simulator subprocess: a dead worker). Doing that
import here, in the calling process, keeps the error one line; children inherit the environment. A
valid value that cannot render here (``glfw`` without a display) is no error: ``eval.video`` says why.
"""

from __future__ import annotations

import os
import sys

OFFSCREEN = ("egl", "osmesa")
"""Off-screen backends, in the order ``eval.video`` tries them when MUJOCO_GL is unset."""
INSTALL = {"egl": "EGL (an NVIDIA driver, or Mesa's: libegl1 libegl-mesa0 libgl1-mesa-dri)",
           "osmesa": "OSMesa (libosmesa6)"}
"""What provides each off-screen backend: what an error tells the user to install."""


def check_mujoco_gl() -> None:
    """Import MuJoCo under the current ``MUJOCO_GL``; a one-line ``ValueError`` when that value stops the import
    (with MUJOCO_GL unset a failure is not about rendering and is raised as it is)."""
    if "mujoco" in sys.modules:
        return
    value = os.environ.get("MUJOCO_GL", "")
    try:
        import mujoco  # noqa: F401 - the import is the check
    except Exception as err:  # whatever the GL backend's import raises
        if not value.strip() or (isinstance(err, ModuleNotFoundError) and err.name == "mujoco"):
            raise
        todo = "run `unset MUJOCO_GL` (or set MUJOCO_GL=egl) and start again"
        if "invalid value for environment variable MUJOCO_GL" in str(err):
            what = "is not a value MuJoCo accepts"
        else:
            what = f"names a backend MuJoCo cannot load here ({type(err).__name__}: " \
                   f"{(str(err).strip().splitlines() or [''])[-1]})"
            if value.strip().lower() in INSTALL:
                todo = (f"install {INSTALL[value.strip().lower()]}, or run `unset MUJOCO_GL` (or set it to another "
                        "of these) and start again")
        raise ValueError(f"MUJOCO_GL={value} {what}, so no MuJoCo simulator can load, with or without video; valid "
                         f"values: egl, osmesa, glfw, or unset; {todo}") from err

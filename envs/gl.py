"""Which OpenGL backend MuJoCo uses (``MUJOCO_GL``), checked before any simulator is built.

MuJoCo reads ``MUJOCO_GL`` when it is first imported, not when something renders: a value it does not
accept (``MUJOCO_GL=nonsense``), or a backend whose library is missing (``MUJOCO_GL=osmesa`` without
OSMesa), makes ``import mujoco`` itself fail. Every simulator then fails to load, rollouts without a
video included, with a traceback deep inside MuJoCo or PyOpenGL, and in a simulator subprocess (or a
forkserver that preloads MuJoCo) it surfaces as a dead worker. ``check_mujoco_gl`` does that import
in the calling process, where an error is still one clear line, so callers run it before they start
simulator processes; the children inherit the environment, so what imports here imports there.

A valid value that cannot render here (``glfw`` without a display) is not an error at this point:
simulators load and step without rendering, and ``eval.video`` says why no video was recorded.
"""

from __future__ import annotations

import os
import sys

OFFSCREEN = ("egl", "osmesa")
"""Off-screen backends, in the order ``eval.video`` tries them when MUJOCO_GL is unset."""

VALID = "egl, osmesa, glfw, or unset"
"""What to set MUJOCO_GL to (MuJoCo accepts a few more spellings; these are the ones that matter here)."""

INSTALL = {"egl": "EGL (an NVIDIA driver, or Mesa's: libegl1 libegl-mesa0 libgl1-mesa-dri)",
           "osmesa": "OSMesa (libosmesa6)"}
"""What provides each off-screen backend: what an error tells the user to install."""


def check_mujoco_gl() -> None:
    """Import MuJoCo under the current ``MUJOCO_GL``; raise ``ValueError`` (one line: the value, the
    valid ones, what to do) when that value stops the import. A plain ``ValueError``, so entry points
    print it as one ``error:`` line and a simulator subprocess's report of it reads the same.

    Cheap once MuJoCo is imported (a dictionary lookup). With MUJOCO_GL unset an import failure is
    not about rendering and is raised as it is."""
    if "mujoco" in sys.modules:
        return
    value = os.environ.get("MUJOCO_GL", "")
    try:
        import mujoco  # noqa: F401 - the import is the check
    except Exception as err:  # whatever the GL backend's import raises
        if not value.strip() or (isinstance(err, ModuleNotFoundError) and err.name == "mujoco"):
            raise
        raise ValueError(mujoco_gl_message(value, err)) from err


def mujoco_gl_message(value: str, err: BaseException) -> str:
    """The one-line error for a MUJOCO_GL value that stops MuJoCo from loading."""
    key = value.strip().lower()
    todo = "run `unset MUJOCO_GL` (or set MUJOCO_GL=egl) and start again"
    if "invalid value for environment variable MUJOCO_GL" in str(err):
        what = "is not a value MuJoCo accepts"
    else:
        cause = (str(err).strip().splitlines() or [""])[-1]
        what = f"names a backend MuJoCo cannot load here ({type(err).__name__}: {cause})"
        if key in INSTALL:
            todo = (f"install {INSTALL[key]}, or run `unset MUJOCO_GL` (or set it to another of these) "
                    "and start again")
    return (f"MUJOCO_GL={value} {what}, so no MuJoCo simulator can load, with or without video; valid values: "
            f"{VALID}; {todo}")

"""Writing output files with the permissions a user expects, into directories that may take them.

``safetensors.torch.save_file`` creates its file with mode 0600 whatever the umask (it writes a private
temporary file and renames it), so a packed or generated checkpoint could not be read by other users or a
service account. :func:`save_safetensors` writes the same file and then gives it the mode an ordinary
``open(path, "w")`` would have: 0666 minus the process umask (0644 under the usual umask 022).
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask (an int such as 0o022). Reads it by setting and restoring it; raises nothing."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_file_mode() -> int:
    """Permission bits of a newly created ordinary file under the current umask (``0o666 & ~umask``)."""
    return 0o666 & ~current_umask()


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> Path:
    """Write ``tensors`` (name -> contiguous CPU tensor) to the safetensors file ``path`` with ordinary
    permissions (``0o666 & ~umask``, not safetensors' 0600); returns ``path`` as a Path.

    Raises:
        OSError: the file cannot be written or its mode set. Errors of ``safetensors.torch.save_file``
            (e.g. non-contiguous or shared tensors) pass through unchanged.
    """
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, normal_file_mode())
    return path


def load_safetensors(path: str | Path, error: type[Exception]) -> dict:
    """The tensors of the safetensors file ``path`` (name -> CPU tensor).

    Raises:
        error: (the caller's one-line error class) the file is truncated, corrupted or unreadable, naming it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise error(f"{path} is not a readable safetensors file (truncated or corrupted?): {str(e)[:120]}") from None


__all__ = ["current_umask", "load_safetensors", "normal_file_mode", "save_safetensors"]


def output_dir(path: str | Path, flag: str = "output", empty: bool = False, error: type = None) -> Path:
    """``Path(path)`` after checking, before any work, that it can be an output directory: it must not be a
    file, nor a dangling symlink, nor lie under a file; its nearest existing ancestor must be a directory this
    process may create a directory in (``os.access``, then a real probe: a temporary subdirectory made and
    removed at once, which catches read-only and pseudo file systems; it touches that directory's mtime); with
    ``empty`` it must be new or empty (never mix new files into, or overwrite, an existing checkpoint). ``flag``
    names it in the message (``--out``). Raises ``error`` (default SpecPilotError)."""
    import os
    import tempfile

    from specpilot.errors import SpecPilotError

    err = error or SpecPilotError
    p = Path(path)
    try:
        if p.is_symlink() and not p.exists():
            raise err(f"{flag} {p} is a dangling symbolic link")
        if p.exists() and not p.is_dir():
            raise err(f"{flag} {p} exists and is not a directory")
        parent = p.absolute()
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise err(f"{flag} {p}: {parent} is a file, so no directory can be made under it")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise err(f"{flag} {p}: {parent} is not writable here")
        os.rmdir(tempfile.mkdtemp(prefix=".specpilot-probe-", dir=parent))
        if empty and p.exists() and any(p.iterdir()):
            raise err(f"{flag} {p} is not empty: choose a new or empty directory")
    except OSError as e:  # a parent we may not search, a read-only or pseudo file system
        raise err(f"{flag} {p}: cannot create a directory there ({e.strerror or type(e).__name__})") from None
    return p

"""One rule for every command that writes files into a folder (``hbfp build``, ``hbfp verilog``,
``hbfp train``): it never overwrites a file it did not write, never writes through a symbolic
link, and refuses a folder it cannot use (a file in the way, ``-o FILE``) before any work.

What a command wrote into a folder is recorded there (its ``manifest``, one per command), so
the next run of that command replaces those files, and only those: everything else in the
folder is the user's and is kept (``Output``). ``OutputConflict`` says what is in the way,
``OutputNotWritable`` why the folder cannot be made or written; both are ``OutputError``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["OutputError", "OutputConflict", "OutputNotWritable", "Output", "check_folder"]


class OutputError(OSError):
    """An output folder that a command cannot use; raised before the command writes anything."""


class OutputConflict(OutputError, FileExistsError):
    """Something that is not the command's own is in the way of its output: a file or a
    symbolic link where its folder goes, or, in that folder, files it would overwrite that no
    earlier run recorded as its own (the user's)."""


class OutputNotWritable(OutputError, PermissionError):
    """The output folder cannot be made or written: no permission, a read-only or special file
    system, a name longer than the file system takes."""


def check_folder(directory: Path, command: str) -> None:
    """``directory`` is a folder or can be made one: no file or symbolic link in the way, and
    the folder (or the nearest one above it that exists) takes new entries."""
    directory = Path(directory)
    try:
        os.lstat(directory)
    except (FileNotFoundError, NotADirectoryError):
        pass  # to be made; a file on the way is named below
    except OSError as e:  # a name too long, a loop of links
        raise OutputNotWritable(f"{command} cannot use {directory}: {e.strerror or e}; choose another output folder "
                                "(-o)") from None
    if directory.is_symlink():
        raise OutputConflict(f"{directory} is a symbolic link: {command} writes its output only into a real folder "
                             "(remove the link or choose another output folder, -o)")
    if directory.exists() and not directory.is_dir():
        raise OutputConflict(f"{directory} is a file, not a folder: it is in the way of {command}'s output "
                             "(move it or choose another output folder, -o)")
    existing = directory if directory.is_dir() else None
    for parent in directory.parents:
        if existing is not None:
            break
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise OutputConflict(f"{parent} is not a folder: it is in the way of {command}'s output {directory}")
            existing = parent
    _check_writable(directory, existing or Path("."), command)


def _check_writable(directory: Path, existing: Path, command: str) -> None:
    """The folders still to be made below ``existing`` have names the file system takes, and
    ``existing`` takes a new entry: tried by making an empty folder there and removing it (the
    only test that also holds for root, read-only mounts and /proc)."""
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    to_make = directory.relative_to(existing).parts if existing != directory else ()
    for name in to_make:
        if len(os.fsencode(name)) > name_max:
            raise OutputNotWritable(f"{directory}: the folder name {name[:20]}... is longer than the file system "
                                    f"takes ({name_max} bytes); choose another output folder (-o)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hbfp-", dir=existing))
    except OSError as e:
        where = directory if existing == directory else f"{existing} (to make {directory})"
        raise OutputNotWritable(f"{command} cannot write into {where}: {e.strerror or e}; choose another output "
                                "folder (-o)") from None


class Output:
    """A command's files in ``directory``: ``names`` (paths relative to it) to be written, in
    its ``manifest``. Refuses (``OutputConflict``) at once, before anything is written, if a
    file to be written, or one its tools may write (``tool_prefix``.*, ``tool_files``), is there
    and was not recorded by the command's previous run, or is a symbolic link or a folder.
    ``begin`` removes the previous run's recorded files (none outlives it) and claims the new
    ones, ``put`` writes one (never through a link), ``write`` does both for a dict of
    contents; nothing else in the folder is touched."""

    def __init__(self, directory: Path, names, *, command: str, manifest: str, tool_prefix: str | None = None,
                 tool_files=()):
        self.directory = Path(directory)
        self.command, self.manifest = command, manifest
        check_folder(self.directory, command)
        self.planned = [Path(n).as_posix() for n in names]
        self.previous = self._read_manifest()
        self.ours: set[str] = set()
        self._check(tool_prefix, tuple(tool_files))
        self._before: set[str] = set()

    def _read_manifest(self) -> set[str]:
        path = self.directory / self.manifest
        if path.is_symlink() or not path.is_file():
            return set()
        try:
            names = json.loads(path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return set()
        ok = set()
        for name in names if isinstance(names, list) else ():
            if not isinstance(name, str):
                continue
            rel = Path(name)
            if name and not rel.is_absolute() and ".." not in rel.parts and rel.as_posix() != self.manifest:
                ok.add(rel.as_posix())
        return ok

    def _ours(self, rel: str) -> bool:
        """``rel`` was written by the previous run and is still a plain file."""
        path = self.directory / rel
        return rel in self.previous and path.is_file() and not path.is_symlink()

    def _check(self, tool_prefix: str | None, tool_files: tuple[str, ...]) -> None:
        d = self.directory
        if not d.is_dir():
            return  # made by begin()
        problems = []

        def check(rel: str) -> None:
            path = d / rel
            for parent in list(Path(rel).parents)[:-1][::-1]:  # folders inside d on the way
                p = d / parent
                if p.is_symlink() or (p.exists() and not p.is_dir()):
                    problems.append(f"{parent.as_posix()} (not a folder)")
                    return
            if not os.path.lexists(path):
                return
            if path.is_symlink():
                problems.append(f"{rel} (a symbolic link)")
            elif path.is_dir():
                problems.append(f"{rel} (a folder)")
            elif rel not in self.previous:
                problems.append(rel)

        manifest = d / self.manifest
        if manifest.is_symlink() or (manifest.exists() and not manifest.is_file()):
            problems.append(f"{self.manifest} (not a plain file)")  # a plain one is always the command's own
        for rel in [*self.planned, *tool_files]:
            check(rel)
        if tool_prefix:
            for entry in sorted(d.iterdir()):
                if entry.name.startswith(tool_prefix + ".") and entry.name not in self.planned:
                    check(entry.name)
        if problems:
            shown = ", ".join(problems[:6]) + (f" and {len(problems) - 6} more" if len(problems) > 6 else "")
            hint = "" if manifest.is_file() else f" (no {self.manifest} records an earlier run's files)"
            raise OutputConflict(f"{d} holds files that {self.command} would overwrite and did not write{hint}: "
                                 f"{shown}; move them away or choose another output folder (-o)")

    def _save(self) -> None:
        self._put(self.manifest, json.dumps({"written_by": self.command, "files": sorted(self.ours)}, indent=1) + "\n")

    def _all_files(self) -> set[str]:
        found = set()
        for root, _, names in os.walk(self.directory):
            for name in names:
                found.add((Path(root) / name).relative_to(self.directory).as_posix())
        found.discard(self.manifest)
        return found

    def _put(self, rel: str, content) -> None:
        path = self.directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else bytes(content)
        # O_NOFOLLOW: a symbolic link put there since the check is refused, not followed
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def begin(self) -> None:
        """Remove the previous run's files and claim the new ones (an interrupted run's files
        stay the command's own)."""
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        for rel in sorted(self.previous - set(self.planned)):
            if self._ours(rel):
                (d / rel).unlink()
        self.ours = set(self.planned)
        self._save()

    def put(self, rel: str, content) -> Path:
        """Write one of the planned files (text or bytes)."""
        rel = Path(rel).as_posix()
        if rel not in self.ours:
            raise ValueError(f"{rel} is not one of the files {self.command} planned to write")
        self._put(rel, content)
        return self.directory / rel

    def write(self, files: dict) -> None:
        """``begin``, then every file of ``files`` (relative path -> text or bytes)."""
        self.begin()
        for rel, content in files.items():
            self.put(rel, content)
        self._before = self._all_files()

    def record_new(self) -> None:
        """Record the files that appeared since ``write`` (its tools' output) as the command's."""
        self.ours |= self._all_files() - self._before
        self._save()

    def files(self) -> list[Path]:
        return sorted(self.directory / rel for rel in self.ours if (self.directory / rel).is_file())

"""SWE-agent's and OpenHands' ``str_replace_editor``, run inside the episode's sandbox.

Standard library only: it runs under the sandbox's interpreter as the episode's uid, so an
edit can reach nothing the agent's own commands could not. It reads one JSON object on
stdin, ``{"command": view|create|str_replace|insert|undo_edit, "path": ..., ...}``, does it,
and prints what the tool answers; a refused call exits 1 with the reason. Undo history is
kept under ``/testbed/.git/agentgym-undo`` (inside the workspace, outside any diff).
"""

import json
import os
import sys

ROOT = "/testbed"
UNDO = os.path.join(ROOT, ".git", "agentgym-undo")
SNIPPET = 4  # lines shown around an edit
MAX_VIEW = 16000  # characters of a file's view before it must be viewed by range


class Refused(Exception):
    pass


def numbered(text, start=1):
    lines = text.split("\n")
    return "\n".join(f"{i + start:6}\t{line}" for i, line in enumerate(lines))


def undo_file(path):
    return os.path.join(UNDO, path.strip("/").replace("/", "%") + ".json")


def remember(path, before):
    os.makedirs(UNDO, exist_ok=True)
    stack = json.load(open(undo_file(path))) if os.path.exists(undo_file(path)) else []
    stack.append(before)
    with open(undo_file(path), "w") as f:
        json.dump(stack, f)


def read(path):
    if not os.path.isfile(path):
        raise Refused(f"The path {path} does not exist or is not a file.")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().expandtabs()


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def snippet(path, text, line):
    lines = text.split("\n")
    lo, hi = max(0, line - SNIPPET), min(len(lines), line + SNIPPET + 1)
    return (f"The file {path} has been edited. Here's the result of running `cat -n` on a "
            f"snippet of {path}:\n{numbered(chr(10).join(lines[lo:hi]), lo + 1)}\n"
            "Review the changes and make sure they are as expected. Edit the file again if "
            "necessary.")


def view(path, view_range):
    if os.path.isdir(path):
        if view_range:
            raise Refused("The `view_range` parameter is not allowed when `path` points to "
                          "a directory.")
        found = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            depth = root[len(path):].count("/")
            if depth >= 2:
                dirs[:] = []
            found += [os.path.join(root, n) for n in sorted(files) if not n.startswith(".")]
            found += [os.path.join(root, d) for d in dirs]
        listing = "\n".join(sorted(found))
        return (f"Here's the files and directories up to 2 levels deep in {path}, excluding "
                f"hidden items:\n{path}\n{listing}")
    text = read(path)
    start = 1
    if view_range:
        if not (isinstance(view_range, list) and len(view_range) == 2
                and all(isinstance(v, int) for v in view_range)):
            raise Refused("`view_range` must be a list of two integers, [start, end].")
        lines = text.split("\n")
        lo, hi = view_range
        if not 1 <= lo <= len(lines):
            raise Refused(f"Invalid `view_range`: {view_range}. Its first element `{lo}` "
                          f"should be within the range of lines of the file: "
                          f"[1, {len(lines)}].")
        hi = len(lines) if hi == -1 else hi
        if hi < lo:
            raise Refused(f"Invalid `view_range`: {view_range}. Its second element `{hi}` "
                          f"should be larger or equal than its first `{lo}`.")
        text, start = "\n".join(lines[lo - 1:hi]), lo
    elif len(text) > MAX_VIEW:
        raise Refused(f"The file {path} has {text.count(chr(10)) + 1} lines, too long to "
                      f"view whole: give a `view_range`, or search it with grep -n.")
    return f"Here's the result of running `cat -n` on {path}:\n{numbered(text, start)}"


def main(call):
    command, path = call.get("command"), call.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise Refused(f"The path {path} is not an absolute path, it should start with `/`. "
                      f"Maybe you meant {os.path.join(ROOT, str(path))}?")
    if command == "view":
        return view(path, call.get("view_range"))
    if command == "create":
        if os.path.exists(path):
            raise Refused(f"File already exists at: {path}. Cannot overwrite files using "
                          "command `create`.")
        if not isinstance(call.get("file_text"), str):
            raise Refused("Parameter `file_text` is required for command: create")
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        write(path, call["file_text"])
        return f"File created successfully at: {path}"
    if command == "str_replace":
        old, new = call.get("old_str"), call.get("new_str") or ""
        if not isinstance(old, str) or not old:
            raise Refused("Parameter `old_str` is required for command: str_replace")
        text = read(path)
        n = text.count(old.expandtabs())
        if n == 0:
            raise Refused(f"No replacement was performed, old_str `{old}` did not appear "
                          f"verbatim in {path}.")
        if n > 1:
            lines = [i + 1 for i, line in enumerate(text.split("\n")) if old.split("\n")[0] in line]
            raise Refused(f"No replacement was performed. Multiple occurrences of old_str "
                          f"`{old}` in lines {lines}. Please ensure it is unique")
        remember(path, text)
        line = text.split(old.expandtabs())[0].count("\n")
        text = text.replace(old.expandtabs(), new.expandtabs())
        write(path, text)
        return snippet(path, text, line + new.count("\n"))
    if command == "insert":
        line, new = call.get("insert_line"), call.get("new_str")
        if not isinstance(new, str):
            raise Refused("Parameter `new_str` is required for command: insert")
        text = read(path)
        lines = text.split("\n")
        if not isinstance(line, int) or not 0 <= line <= len(lines):
            raise Refused(f"Invalid `insert_line` parameter: {line}. It should be within the "
                          f"range of lines of the file: [0, {len(lines)}]")
        remember(path, text)
        text = "\n".join(lines[:line] + new.expandtabs().split("\n") + lines[line:])
        write(path, text)
        return snippet(path, text, line)
    if command == "undo_edit":
        stack = json.load(open(undo_file(path))) if os.path.exists(undo_file(path)) else []
        if not stack:
            raise Refused(f"No edit history found for {path}.")
        write(path, stack.pop())
        with open(undo_file(path), "w") as f:
            json.dump(stack, f)
        return f"Last edit to {path} undone successfully.\n{view(path, None)}"
    raise Refused(f"Unrecognized command {command!r}. The allowed commands for the "
                  "str_replace_editor tool are: view, create, str_replace, insert, undo_edit")


if __name__ == "__main__":
    try:
        print(main(json.loads(sys.stdin.read())))
    except Refused as e:
        print(f"ERROR: {e}")
        sys.exit(1)
    except OSError as e:
        print(f"ERROR: {e.strerror or e}: {getattr(e, 'filename', '')}")
        sys.exit(1)

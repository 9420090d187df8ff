"""tools/code_layout.py on a tiny synthetic tree whose figures are counted by hand: two rooms in an import circle,
E402 comments (and a string that only spells one), function sizes, and a config path of known modules and returns."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_layout", ROOT / "tools" / "code_layout.py")
code_layout = sys.modules["code_layout"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(code_layout)

# Two rooms, `mercury_jax` (3 modules) and `models` (2 modules). Arrows between modules:
#   mercury_jax.entry -> models.helpers, mercury_jax.entry -> models          (module level)
#   models.helpers -> mercury_jax.entry (module level), models.helpers -> mercury_jax.other (in a function)
#   models -> models.helpers                                                  (inside the room)
TREE = {
    "mercury_jax/__init__.py": "",
    "mercury_jax/entry.py": '''
        """The entry; its docstring is not code."""
        import os

        os.environ["X"] = "1"
        import models  # noqa: E402
        from models import helpers  # noqa:E402,F401
        from models.helpers import Thing  # noqa: F401


        def run(config, workdir):
            local(config.a)
            helpers.prepare(config)
            Thing(config.thing)
            unrelated(workdir)
            configure(workdir, options=config.options)


        def local(section):
            models.build(section, 3)


        def configure(path, options):
            helpers.render(options.get("x"))
            helpers.render(path)


        def finish_up(cfg):
            return cfg


        def unrelated(x):
            return x
        ''',
    "mercury_jax/other.py": '''
        TEXT = "# noqa: E402 in a string is no comment"


        def wide(a, b, c, /, d, *args, e, **kwargs):
            return a


        def long_one():
            x = 1
            x += 1
            x += 1
            x += 1
            x += 1
            x += 1
            x += 1
            return x
        ''',
    "models/__init__.py": "from models.helpers import build\n",
    "models/helpers.py": '''
        from mercury_jax import entry


        def prepare(cfg):
            """Docstring lines count as lines of the function, not as code lines."""
            build(cfg)
            entry.finish_up(cfg)


        def build(cfg, n=1):
            from mercury_jax import other  # noqa: PLC0415
            return other.TEXT, n


        def render(value):
            return value


        class Thing:
            def __init__(self, section):
                self.finish(section.x)

            def finish(self, value):
                return value
        ''',
    "tests/test_x.py": "import os  # noqa: E402\n",
    "experiments/x.py": "def huge(a, b, c, d, e, f, g, h, i, j, k, l):\n    pass\n",
}


def write_tree(root: Path) -> Path:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


@pytest.fixture
def report(tmp_path):
    return code_layout.measure(write_tree(tmp_path), ["mercury_jax.entry:run:config"])


def test_rooms_and_their_largest_functions(report):
    rooms = {row["room"]: row for row in report["rooms"]}
    assert set(rooms) == {"mercury_jax", "models"} and report["modules"] == 5
    assert report["largest_room"] == "mercury_jax"
    assert [rooms["mercury_jax"]["modules"], rooms["models"]["modules"]] == [3, 2]
    # entry.py: 32 lines less 11 blank and 1 docstring; other.py: 16 less 4 blank; helpers.py: 24 less 9 blank and 1
    # docstring; models/__init__.py: 1
    assert [rooms["mercury_jax"]["lines"], rooms["models"]["lines"]] == [32 + 16, 1 + 24]
    assert rooms["mercury_jax"]["code_lines"] == 20 + 12
    assert rooms["models"]["code_lines"] == 1 + 14
    assert rooms["mercury_jax"]["longest_function"] == ["other:long_one", 9]
    assert rooms["mercury_jax"]["most_parameters"] == ["other:wide", 7]
    assert rooms["models"]["longest_function"] == ["helpers:prepare", 4]
    assert rooms["models"]["most_parameters"] == ["helpers:build", 2]  # self is not counted: Thing.__init__ has 1


def test_arrows_circles_and_floors(report):
    assert report["room_pairs"] == {"models -> mercury_jax": 2, "mercury_jax -> models": 2}
    assert report["arrows"] == 4 and report["arrows_inside"] == 1
    assert report["room_circles"] == [["mercury_jax", "models"]]
    assert report["module_circles"] == [["mercury_jax.entry", "models", "models.helpers"]]
    # the search starts at mercury_jax: models is floor 0, mercury_jax floor 1; of the two arrows from models back
    # to mercury_jax, the one inside a function does not count
    assert report["room_floor"] == {"mercury_jax": 1, "models": 0} and report["floors"] == 2
    assert report["arrows_up_list"] == ["models.helpers -> mercury_jax.entry"] and report["arrows_up"] == 1


def test_e402_counts_comments_only(report):
    assert report["e402"] == 2  # entry.py's two; other.py's string does not count
    assert report["e402_tree"] == 3  # and tests/test_x.py's


def test_config_path(report):
    """run(config): local(config.a) -> models.build via the package's re-export (enter models.helpers, return);
    helpers.prepare(config) (enter, return) -> build(cfg) seen already, entry.finish_up(cfg) (enter mercury_jax.entry,
    which is on the stack, return); Thing(config.thing) enters Thing.__init__ (enter, return) -> self.finish (same
    module); unrelated(workdir) is not followed; configure(options=config.options) -> helpers.render(options.get)
    (enter, return), render(path) not followed. Nine functions, five crossings, each returning."""
    (path,) = report["config_paths"]
    assert path["functions"] == 9
    assert path["modules_entered"] == 5 and path["returns"] == 5
    assert path["distinct_modules"] == 2 and path["back_into_stack"] == 1
    assert path["most_entered"] == ["models.helpers", 4]
    assert [step.strip() for step in path["steps"]] == [
        "mercury_jax.entry:run(config)", "mercury_jax.entry:local(section)", "models.helpers:build(cfg)",
        "models.helpers:prepare(cfg)", "mercury_jax.entry:finish_up(cfg)", "models.helpers:Thing.__init__(section)",
        "models.helpers:Thing.finish(value)", "mercury_jax.entry:configure(options)", "models.helpers:render(value)"]


def test_missing_entry_and_path_form(tmp_path):
    root = write_tree(tmp_path)
    paths = code_layout.measure(root, ["mercury_jax/entry.py:run:config", "mercury_jax.entry:nope:config"])
    assert paths["config_paths"][0]["returns"] == 5 and paths["config_paths"][1]["missing"]


def test_git_revision_and_json(tmp_path, capsys):
    root = write_tree(tmp_path)
    git = lambda *args: subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree")
    (root / "models" / "extra.py").write_text("x = 1\n")  # after the commit: not in HEAD
    code_layout.main(["--root", str(root), "--git", "HEAD", "--json", "--entry", "mercury_jax.entry:run:config"])
    measured = json.loads(capsys.readouterr().out)
    assert measured["modules"] == 5 and measured["config_paths"][0]["returns"] == 5
    code_layout.main(["--root", str(root), "--entry", "mercury_jax.entry:run:config"])
    table = capsys.readouterr().out
    assert table.startswith("6 modules") and "noqa: E402: 2 in the measured packages, 3" in table

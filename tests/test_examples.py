"""The operator's examples (examples/): the service unit runs a program that `meson install`
installs, every option they give is one hapifs takes, and the cache directory they name is made
on a fresh node."""
import json
import re
import shlex
import subprocess

from conftest import BUILD_ROOT, HAPIFS, SOURCE_ROOT, Mount, is_mounted, need_hapifs

EXAMPLES = SOURCE_ROOT / "examples"
GENERIC = {"allow_other", "_netdev", "nofail", "ro", "rw", "defaults", "noauto", "auto", "user",
           "users"}  # mount(8)'s and FUSE's, not hapifs's


def installed_paths():
    """Where `meson install` puts each built program (meson introspect --installed)."""
    r = subprocess.run(["meson", "introspect", "--installed", str(BUILD_ROOT)],
                       capture_output=True, text=True, check=True)
    return set(json.loads(r.stdout).values())


def hapifs_option_names():
    help_text = subprocess.run([str(HAPIFS), "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+([a-z_]+)(?:=|\s)", help_text, re.M))


def example_options():
    """{file: [option names]} of every -o list the examples give."""
    out = {}
    for f in EXAMPLES.iterdir():
        text = f.read_text(errors="replace")
        lists = []
        if f.suffix == ".service":
            for line in text.splitlines():
                if line.startswith("ExecStart="):
                    argv = shlex.split(line[len("ExecStart="):])
                    lists += [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
        elif f.suffix == ".mount":
            lists += [l[len("Options="):] for l in text.splitlines() if l.startswith("Options=")]
        elif f.name == "fstab.example":
            lists += [l.split()[3] for l in text.splitlines()
                      if l.strip() and not l.startswith("#") and len(l.split()) >= 4]
        if lists:
            out[f.name] = [o.split("=", 1)[0] for opts in lists for o in opts.split(",")]
    return out


def test_the_service_runs_an_installed_program():
    need_hapifs()
    units = list(EXAMPLES.glob("*.service"))
    assert units
    installed = installed_paths()
    for unit in units:
        for line in unit.read_text().splitlines():
            if line.startswith(("ExecStart=", "ExecStop=")):
                prog = shlex.split(line.split("=", 1)[1])[0]
                if "hapifs" in prog.rsplit("/", 1)[-1]:
                    assert prog in installed, (unit.name, prog, sorted(installed))


def test_every_option_of_the_examples_is_one_hapifs_takes():
    need_hapifs()
    known = hapifs_option_names()
    assert {"model", "cache", "cache_size", "split"} <= known, known
    opts = example_options()
    assert set(opts) >= {"fstab.example", "hapifs-data.mount", "hapifs-feat.service"}, opts
    for name, keys in opts.items():
        unknown = [k for k in keys if k not in known and k not in GENERIC]
        assert not unknown, (name, unknown)


def test_the_cache_directory_is_made_with_its_parents(tmp_path, models):
    need_hapifs()
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    cache = tmp_path / "var" / "cache" / "hapifs" / "imagenet"  # as the examples name it
    m = Mount(src, mnt, {"model": str(models()), "cache": str(cache), "prefetch": "off"})
    try:
        assert (cache / "data.mdb").exists()
        assert m.ctl("config")["cache"]["dir"] == str(cache)
    finally:
        m.unmount()
    assert not is_mounted(mnt)


def help_options(text):
    """The option names a --help text lists: its lines indented four spaces."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"^ {4}([a-z][a-z_]*)(?:=\S*)?(?: {2,}|$)", line)
        if m:
            names.add(m.group(1))
        elif re.match(r"^ {4}[a-z_]+, ", line):  # "default_permissions, nosuid, ...: as ..."
            names |= set(re.findall(r"([a-z_]+)(?:, |:)", line.split(":")[0] + ":"))
    return names


def test_the_readme_lists_every_option_and_command():
    need_hapifs()
    readme = (SOURCE_ROOT / "README.md").read_text()
    # the first cell of each table row (a cell's own | is escaped: \\|)
    rows = "\n".join(l[2:].split(" | ")[0] for l in readme.splitlines() if l.startswith("| `"))
    in_readme = set(re.findall(r"`([a-z][a-z_]*)(?:=[^`]*)?`", rows))
    options = help_options(subprocess.run([str(HAPIFS), "--help"], capture_output=True,
                                          text=True).stdout)
    assert {"model", "refresh", "fetch_threads", "uring", "nosuid"} <= options, options
    assert not options - in_readme, sorted(options - in_readme)
    ctl_help = subprocess.run([str(BUILD_ROOT / "tools" / "hapifs-ctl"), "--help"],
                              capture_output=True, text=True).stdout
    commands = set(re.findall(r"^ {4}([a-z][a-z-]*)", ctl_help, re.M)) - {"json", "help"}
    assert {"status", "set-rtt", "set-compute-cache", "evict"} <= commands, commands
    line = next(l for l in readme.splitlines() if l.startswith("`hapifs-ctl [--json]"))
    listed = set(re.findall(r"([a-z][a-z-]*)", line))
    assert not commands - listed, sorted(commands - listed)


def policy_input_lines(help_text):
    """{name: (value, text)} of --help's policy inputs, the lines their table
    (policy/inputs.c) prints, each one's wrapped text joined."""
    section = help_text.split("\npolicy inputs", 1)[1].split("\n\n", 1)[0]
    lines, name = {}, None
    for line in section.splitlines():
        m = re.match(r"^ {4}([a-z_]+)=(\S+) {2,}(.*)", line)
        if m:
            name = m.group(1)
            lines[name] = (m.group(2), m.group(3))
        elif name and line.startswith(" " * 25):
            lines[name] = (lines[name][0], lines[name][1] + " " + line.strip())
    return lines


def test_the_policy_inputs_state_the_same_range_and_default_everywhere():
    """--help prints the policy inputs from their table; README.md's option table and hapifs(8)
    state each one's range and default as the table does."""
    need_hapifs()
    help_text = subprocess.run([str(HAPIFS), "--help"], capture_output=True, text=True).stdout
    inputs = policy_input_lines(help_text)
    assert {"link", "rtt", "transport", "client_speed", "compute_file_ms", "epochs"} <= set(
        inputs), inputs
    readme = (SOURCE_ROOT / "README.md").read_text().splitlines()
    page = (SOURCE_ROOT / "tools" / "hapifs.8.scd").read_text().replace("\\_", "_")
    for name, (value, text) in inputs.items():
        fallback = re.search(r"\(default (\S+)\)$", text).group(1)
        ranges = re.findall(r"(\S+\.\.[^\s,]+)", text)
        row = next(l for l in readme if l.startswith(f"| `{name}="))
        assert row.startswith(f"| `{name}={value.replace('|', chr(92) + '|')}` |"), (row, value)
        assert f"default `{fallback}`" in row, (name, fallback, row)
        block = page.split(f"\n*{name}=*", 1)[1].split("\n*", 1)[0]
        assert f"Default: *{fallback}*" in block, (name, fallback, block)
        for r in ranges:  # none for file|pack, whose words are its value
            assert f"`{r}`" in row, (name, r, row)
            assert f"*{r}*" in block, (name, r, block)

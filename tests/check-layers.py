#!/usr/bin/python3
"""Checks the daemon's include graph against the map in fusefs/layers.h.

Every fusefs/*.c and *.h must be in the map's table; none may include the
header of a layer of a higher rank than its own; only the FUSE-speaking files
the map lists may include <fuse_lowlevel.h> or <fuse.h>. Usage:
check-layers.py [SOURCE_ROOT]. Exits 1 with one line per violation.
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), '..')
fusefs = os.path.join(root, 'fusefs')
layers = open(os.path.join(fusefs, 'layers.h')).read()

rank = {}  # file name (header or .c) -> rank
for m in re.finditer(r'^ \*\s+(\d+)\s+(\S+)\s+(\S+)\s', layers, re.M):
    for name in m.group(2, 3):
        if name != '-':
            rank[name] = int(m.group(1))
# the list: the lines after its title, each " *   " and file names only
m = re.search(r'FUSE-speaking files[^\n]*\n((?: \*\s+(?:\S+\.[ch]\s*)+\n)+)', layers)
fuse_speaking = set(m.group(1).replace('*', ' ').split()) if m else set()

problems = []
if not rank or not fuse_speaking:
    problems.append('layers.h: no table of ranks or no list of FUSE-speaking files found')
for name in sorted(os.listdir(fusefs)):
    if not name.endswith(('.c', '.h')):
        continue
    if name not in rank:
        problems.append(f'fusefs/{name}: not in the table of fusefs/layers.h')
        continue
    text = open(os.path.join(fusefs, name)).read()
    for lineno, line in enumerate(text.split('\n'), 1):
        inc = re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', line)
        if not inc:
            continue
        kind, target = inc.groups()
        base = os.path.basename(target)
        if kind == '<' and base in ('fuse_lowlevel.h', 'fuse.h') and name not in fuse_speaking:
            problems.append(f'fusefs/{name}:{lineno}: includes <{target}> but does not speak '
                            f'FUSE (layers.h lists: {" ".join(sorted(fuse_speaking))})')
        if kind == '"' and base in rank and rank[base] > rank[name]:
            problems.append(f'fusefs/{name}:{lineno}: includes "{base}" (rank {rank[base]}), '
                            f'a layer above its own (rank {rank[name]})')

for p in problems:
    print(p)
sys.exit(1 if problems else 0)

"""Renders a deploy template: every ${NAME} (upper case) is replaced by its value, and nginx's own
variables ($host, $proxy_add_x_forwarded_for) are left alone.

    python deploy/render.py TEMPLATE NAME=VALUE ...   # the rendered text on stdout
    python deploy/render.py --compose                 # rewrites deploy/nginx/nginx.conf

Standard library only: the tests import it, and so can a machine without the project installed.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NGINX_TEMPLATE = HERE / "nginx" / "nginx.conf.template"
NGINX_CONF = HERE / "nginx" / "nginx.conf"
# the values of docker-compose.yml: the replicas are the services api-1 and api-2 on port 8000
COMPOSE_NGINX = {"LISTEN": "80", "API_1": "api-1:8000", "API_2": "api-2:8000",
                 "PID": "/var/run/nginx.pid", "TEMP": "/var/cache/nginx"}
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def render(template: str, values: dict[str, str]) -> str:
    """`template` with each ${NAME} replaced; a name without a value, or a value no placeholder
    uses, is an error (a typo would otherwise ship a broken config)."""
    names = set(PLACEHOLDER.findall(template))
    if missing := names - set(values):
        raise KeyError(f"no value for {sorted(missing)}")
    if unused := set(values) - names:
        raise KeyError(f"no placeholder for {sorted(unused)}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def render_nginx(values: dict[str, str]) -> str:
    header = "# Rendered from nginx.conf.template by deploy/render.py: edit the template, not this file.\n"
    return header + render(NGINX_TEMPLATE.read_text(), values)


def main(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):
        print(__doc__)
        return 0
    if argv == ["--compose"]:
        NGINX_CONF.write_text(render_nginx(COMPOSE_NGINX))
        return 0
    if not argv or argv[0].startswith("-") or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    values = dict(a.split("=", 1) for a in argv[1:])
    try:
        sys.stdout.write(render(Path(argv[0]).read_text(), values))
    except (OSError, KeyError) as exc:
        print(f"render.py: {argv[0]}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

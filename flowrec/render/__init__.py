"""Pictures of operator graphs and plans: DOT text, a standalone SVG (its own layered layout engine,
no graphviz needed) and PNG (matplotlib). Reads the graph layer; nothing reads it but the CLI.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.planner.manager import make_plan
    >>> to_svg(make_plan(load_spec("specs/movielens.yaml"))).startswith("<svg")
    True
"""
from flowrec.render.drawing import layout, legend, title, to_dot, to_png, to_svg

__all__ = ["layout", "legend", "title", "to_dot", "to_png", "to_svg"]

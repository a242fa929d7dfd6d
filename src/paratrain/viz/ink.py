"""Text people can read on every picture: one rule for the colour of text on a fill, and
one check of a drawn figure against it.

The rule is WCAG 2's (https://www.w3.org/TR/WCAG21/#contrast-minimum): the contrast ratio
of two colours is (L1 + 0.05) / (L2 + 0.05) of their relative luminances, and text needs
at least 4.5:1 (:data:`TEXT`); a line or border that must be seen against its fill needs
3:1 (:data:`NON_TEXT`, WCAG's non-text contrast). Black or white always reaches 4.5:1 on
any fill, so :func:`ink` picks whichever of the two contrasts more.

:func:`low_contrast` checks a finished figure the way a reader sees it: it draws the
figure once with every text's glyphs made transparent (a text's own box, such as a white
label background, stays), reads the colour behind each text from the pixels, and
reports each text whose colour is below the minimum against it. The tests run it on
every picture the `paratrain viz` commands write (tests/test_viz_readable.py).
"""

from __future__ import annotations

from collections import Counter

TEXT = 4.5
NON_TEXT = 3.0


def luminance(colour) -> float:
    """WCAG relative luminance of any matplotlib colour (name, hex, RGB or RGBA tuple)."""
    from matplotlib.colors import to_rgb

    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
           for c in to_rgb(colour)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a, b) -> float:
    """WCAG contrast ratio of colours ``a`` and ``b``, 1 to 21."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def ink(fill) -> str:
    """Black or white, whichever contrasts more with ``fill`` (always >= 4.5:1)."""
    return "black" if contrast("black", fill) >= contrast("white", fill) else "white"


def edge(colour, fill, minimum: float = NON_TEXT):
    """``colour`` for a border on ``fill``, mixed toward black or white (the side that
    contrasts more with the fill) until it reaches ``minimum``: the hue stays, so a red
    and a green border still differ on a dark cell."""
    from matplotlib.colors import to_rgb

    rgb, toward = to_rgb(colour), to_rgb(ink(fill))
    for k in range(11):
        mixed = tuple(c + (t - c) * k / 10 for c, t in zip(rgb, toward, strict=True))
        if contrast(mixed, fill) >= minimum:
            return mixed
    return toward


def _background(pixels, box) -> tuple[float, float, float] | None:
    """The most common colour of ``pixels`` (H x W x 4 bytes, top row first) inside the
    display box ``box`` (origin bottom left), or None if the box is off the canvas."""
    h, w = pixels.shape[:2]
    x0, x1 = max(0, int(box.x0)), min(w, int(box.x1) + 1)
    y0, y1 = max(0, int(h - box.y1)), min(h, int(h - box.y0) + 1)
    if x0 >= x1 or y0 >= y1:
        return None
    region = pixels[y0:y1, x0:x1, :3].reshape(-1, 3)
    (top, _), = Counter(map(tuple, region.tolist())).most_common(1)
    return tuple(c / 255 for c in top)


def low_contrast(fig, minimum: float = TEXT) -> list[tuple[str, tuple, tuple, float]]:
    """(text, its colour, the colour behind it, ratio) of each visible text of ``fig``
    below ``minimum`` against what it is drawn on."""
    import numpy as np
    from matplotlib.colors import to_rgba
    from matplotlib.text import Text

    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    alphas = [t.get_alpha() for t in texts]
    for t in texts:
        t.set_alpha(0.0)  # the glyphs only: a text's bbox patch keeps its own alpha
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba()).copy()
    for t, a in zip(texts, alphas, strict=True):
        t.set_alpha(a)
    out = []
    for t, box, a in zip(texts, boxes, alphas, strict=True):
        bg = _background(pixels, box)
        if bg is None:
            continue
        r, g, b, own = to_rgba(t.get_color())
        alpha = own if a is None else a
        seen = tuple(alpha * c + (1 - alpha) * k for c, k in zip((r, g, b), bg, strict=True))
        ratio = contrast(seen, bg)
        if ratio < minimum:
            out.append((t.get_text(), seen, bg, round(ratio, 2)))
    return out

"""A small Markdown-to-HTML renderer for chat answers, shaped for QTextBrowser.

Answers arrive a few tokens at a time, so the renderer must accept any prefix
of a document: an unterminated ``` fence renders as an open code block, half a
**bold** stays literal.  Code blocks come out monospace with a "Copy" link
(href `copy:N`); the caller keeps the returned code texts to put on the
clipboard.  Only what chat models write is supported: fenced code, headings,
lists, quotes, rules, paragraphs, and inline code/bold/italic/links.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

MONO = "'JetBrains Mono','DejaVu Sans Mono','Menlo','Consolas',monospace"

_FENCE = re.compile(r"^\s{0,3}(```|~~~)\s*([\w+#.-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBER = re.compile(r"^\s*(\d+)[.)]\s+(.*)$")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_ITALIC = re.compile(r"(?<![\w*])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\w*])|(?<![\w_])_(?=\S)([^_\n]+?)(?<=\S)_(?![\w_])")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^)\s]+)\)")


@dataclass
class Palette:
    code_bg: str = "#f3f4f6"
    code_border: str = "#d1d5db"
    code_head: str = "#6b7280"
    quote: str = "#6b7280"
    link: str = "#2563eb"


LIGHT = Palette(code_border="#e5e7eb")
DARK = Palette(code_bg="#1f2430", code_border="#374151", code_head="#9ca3af", quote="#9ca3af", link="#60a5fa")


def _inline(text: str, pal: Palette) -> str:
    """Escape, then apply inline markup; code spans are protected from the rest."""
    spans: list[str] = []

    def keep(m):
        spans.append(f"<code style=\"font-family:{MONO}; background-color:{pal.code_bg};\">"
                     f"&nbsp;{html.escape(m.group(1))}&nbsp;</code>")
        return f"\x00{len(spans) - 1}\x00"

    text = _INLINE_CODE.sub(keep, text)
    text = html.escape(text, quote=False)
    text = _LINK.sub(lambda m: f'<a href="{html.escape(m.group(2))}" style="color:{pal.link};">{m.group(1)}</a>', text)
    text = _BOLD.sub(r"<b>\2</b>", text)
    text = _ITALIC.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", text)
    return re.sub("\x00(\\d+)\x00", lambda m: spans[int(m.group(1))], text)


def _code_block(code: str, lang: str, n: int, pal: Palette) -> str:
    head = html.escape(lang) if lang else "code"
    body = html.escape(code.rstrip("\n")) or "&nbsp;"
    return (f'<table width="100%" border="0" cellspacing="0" cellpadding="6" '
            f'style="background-color:{pal.code_bg}; margin: 4px 0;">'
            f'<tr style="background-color:{pal.code_border};">'
            f'<td style="color:{pal.code_head}; font-size: small;">{head}</td>'
            f'<td align="right" style="font-size: small;"><a href="copy:{n}" style="color:{pal.link};">Copy</a></td></tr>'
            f'<tr><td colspan="2"><pre style="font-family:{MONO}; margin:0;">{body}</pre></td></tr></table>')


def render(text: str, pal: Palette = LIGHT) -> tuple[str, list[str]]:
    """HTML for `text` (any prefix of a Markdown document) and its code blocks."""
    out: list[str] = []
    codes: list[str] = []
    para: list[str] = []
    list_kind = None          # "ul" | "ol" while inside a list

    def flush_para():
        if para:
            out.append("<p>" + "<br>".join(_inline(line, pal) for line in para) + "</p>")
            para.clear()

    def close_list():
        nonlocal list_kind
        if list_kind:
            out.append(f"</{list_kind}>")
            list_kind = None

    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            flush_para(); close_list()
            marker, lang = fence.group(1), fence.group(2)
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i])
                i += 1
            codes.append("\n".join(body).rstrip("\n"))
            out.append(_code_block(codes[-1], lang, len(codes) - 1, pal))
            i += 1            # the closing fence (or past the end while it streams in)
            continue
        if not line.strip():
            flush_para(); close_list()
        elif m := _HEADING.match(line):
            flush_para(); close_list()
            level = min(len(m.group(1)) + 2, 6)        # chat headings read better smaller
            out.append(f"<h{level}>{_inline(m.group(2), pal)}</h{level}>")
        elif _RULE.match(line):
            flush_para(); close_list()
            out.append("<hr>")
        elif (m := _BULLET.match(line)) or (m2 := _NUMBER.match(line)):
            flush_para()
            kind = "ul" if m else "ol"
            item = m.group(1) if m else m2.group(2)
            if list_kind != kind:
                close_list()
                start = "" if m else f' start="{int(m2.group(1))}"'
                out.append(f"<{kind}{start}>")
                list_kind = kind
            out.append(f"<li>{_inline(item, pal)}</li>")
        elif line.lstrip().startswith(">"):
            flush_para(); close_list()
            out.append(f'<blockquote style="color:{pal.quote};">{_inline(line.lstrip()[1:].strip(), pal)}</blockquote>')
        else:
            if list_kind and line.startswith((" ", "\t")):     # a wrapped list item continues
                out[-1] = out[-1][:-5] + " " + _inline(line.strip(), pal) + "</li>"
            else:
                close_list()
                para.append(line)
        i += 1
    flush_para(); close_list()
    return "".join(out), codes

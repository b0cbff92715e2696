"""Small PDFs written byte by byte for the tests and benchmarks: a page of text, many pages sharing one long content
stream (slow to read), and a page whose compressed content stream expands far past its size."""

from __future__ import annotations

import io
import zlib


def write_pdf(objects: list[bytes]) -> bytes:
    """A PDF of these objects (numbered from 1; object 1 is the catalog), with its cross-reference table."""
    out, offsets = io.BytesIO(), []
    out.write(b"%PDF-1.4\n")
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % offset for offset in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def pages_pdf(content: bytes, pages: int = 1, compress: bool = False) -> bytes:
    """A PDF of `pages` pages that all draw the one content stream `content` (Flate-compressed when `compress`)."""
    stream = zlib.compress(content, 9) if compress else content
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
    page = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
            b"/Resources << /Font << /F1 4 0 R >> >> >>")
    return write_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                      b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
                      b"<< /Length %d%s >>\nstream\n" % (len(stream), b" /Filter /FlateDecode" if compress else b"")
                      + stream + b"\nendstream",
                      b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
                      *[page] * pages])


def text_pdf(text: str) -> bytes:
    """A one-page PDF whose page shows `text` (ASCII)."""
    return pages_pdf(f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode())


def slow_pdf(pages: int, stream_bytes: int = 1 << 20) -> bytes:
    """`pages` pages sharing one compressed content stream of `stream_bytes` that shows empty strings:
    every page costs a parse of the whole stream and adds nothing to the text."""
    line = b"BT /F1 12 Tf 72 720 Td () Tj ET\n"
    return pages_pdf(line * (stream_bytes // len(line)), pages, compress=True)


def bomb_pdf(expanded_bytes: int) -> bytes:
    """One page whose Flate-compressed content stream (about a thousandth of its size) expands to `expanded_bytes`
    of spaces."""
    return pages_pdf(b" " * expanded_bytes, compress=True)

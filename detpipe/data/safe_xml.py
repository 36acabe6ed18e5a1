"""Reading untrusted XML annotation files (Pascal VOC, CVAT) safely: one parser and one error ladder for every
format.

The parser is ``defusedxml``'s (a well-kept library) with ``forbid_dtd``, ``forbid_entities`` and
``forbid_external``: a document type declaration (``<!DOCTYPE ...>``, where entity declarations, billion-laughs
expansion and external entities live; neither VOC nor CVAT files carry one) is refused before anything in it is
declared or fetched. Every failure is one `detpipe.core.errors.StageError` line naming the file, the parser's line (and
column, for malformed XML) and the format's rule.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

from defusedxml import DTDForbidden, DefusedXmlException, EntitiesForbidden, ExternalReferenceForbidden
from defusedxml.ElementTree import DefusedXMLParser

from detpipe.core.errors import StageError


def iter_events(path: Path, rule: str, events: tuple[str, ...] = ("start", "end")) \
        -> Iterator[tuple[str, ET.Element]]:
    """``(event, element)`` of the XML file ``path``, streamed (``ElementTree.iterparse`` on defusedxml's parser).

    Args:
        path: the file.
        rule: the format's rule named in every error (``voc_xml``, ``cvat_xml``).
        events: the iterparse events to yield.
    Raises:
        StageError: ``rule``: a DTD, an entity declaration or an external reference (refused), malformed XML (the
            parser's line and 1-based column and its reason), an unreadable file.
    """
    parser = DefusedXMLParser(target=ET.TreeBuilder(), forbid_dtd=True, forbid_entities=True,
                              forbid_external=True)
    try:
        with open(path, "rb") as f:
            yield from ET.iterparse(f, events, parser=parser)
    except DTDForbidden as e:
        ext = f" SYSTEM {e.sysid!r}" if e.sysid else ""
        raise StageError(f"{path}: line {parser.parser.CurrentLineNumber}: XML document type declaration "
                         f"<!DOCTYPE {e.name}{ext}> refused: a DTD is where entities (billion laughs) and external "
                         f"references (XXE) are declared, and annotation files need none (rule '{rule}')") from None
    except EntitiesForbidden as e:
        raise StageError(f"{path}: XML entity declaration {e.name!r} refused (rule '{rule}')") from None
    except ExternalReferenceForbidden as e:
        raise StageError(f"{path}: XML external reference {e.sysid!r} refused (rule '{rule}')") from None
    except DefusedXmlException as e:
        raise StageError(f"{path}: unsafe XML refused ({e}) (rule '{rule}')") from None
    except ET.ParseError as e:
        line, col = e.position
        raise StageError(f"{path}: line {line}, column {col + 1}: malformed XML ({str(e).split(':')[0]}) "
                         f"(rule '{rule}')") from None
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e}) (rule '{rule}')") from None


def parse(path: Path, rule: str) -> ET.Element:
    """The root element of the XML file ``path``, the whole tree in memory (one annotation file), read by
    `iter_events`.

    Raises:
        StageError: as `iter_events`.
    """
    root = None
    for _, el in iter_events(path, rule, ("end",)):
        root = el                      # the last element to end is the root
    return root

"""Images in fine-tuning rows: where each one is, and whether it can be trained on.

Rows carry images the ways people's datasets do: LLaMA-Factory's `images` column (a list of
paths) with one `<image>` placeholder per image in the turns' text (sharegpt and alpaca shapes),
or OpenAI-style messages whose content holds `image_url` / `image` parts. Either way a row ends
as text with `<image>` placeholders plus the list of image files in placeholder order; the
model's own processor (`AutoProcessor`) turns them into pixels and image tokens later.

A path is resolved against the data file's folder (`file://` URLs too). An http(s) URL is
refused: lmforge reads no network at run time. A missing, unreadable or oversized image makes
the row a bad row with the reason (counted, quarantined under `data.on_bad_row: skip`), never a
silent drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

IMAGE_PLACEHOLDER = "<image>"

# Bad-row reasons (the data report counts rows per reason).
IMAGE_MISSING = "image missing"
IMAGE_UNREADABLE = "image unreadable"
IMAGE_TOO_LARGE = "image too large"
IMAGE_COUNT = "image placeholders"
IMAGE_URL = "image url"
IMAGE_PART = "content part"

# Above this many pixels an image is refused (a decompression bomb, or a scan no processor would
# keep at that size): 8192 x 8192. Pillow's own guard warns at 89M pixels and fails at twice that.
MAX_IMAGE_PIXELS = 8192 * 8192


class ImageError(ValueError):
    """Why a row's image cannot be used: `reason` (one of the constants above) and the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ImageFacts:
    path: Path
    width: int
    height: int


def resolve_image(ref: Any, base_dir: Path) -> Path:
    """The file an image reference names: a path (relative to `base_dir`, the data file's folder)
    or a file:// URL. ImageError for anything else (http(s) URLs, non-strings)."""
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(IMAGE_MISSING, f"an image reference must be a path, got {ref!r}")
    parsed = urlparse(ref)
    if parsed.scheme in ("http", "https"):
        raise ImageError(
            IMAGE_URL,
            f"{ref} is a web address; lmforge reads no network while preparing data: download the image "
            "and give its path (relative to the data file's folder)",
        )
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    path = Path(ref).expanduser()
    return path if path.is_absolute() else base_dir / path


def inspect_image(path: Path, *, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageFacts:
    """Open the image's header and check its data decodes; ImageError when it is missing, is not an
    image Pillow can read, or has more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise ImageError(IMAGE_MISSING, f"{path} does not exist")
    try:
        with Image.open(path) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    IMAGE_TOO_LARGE, f"{path} is {width}x{height} pixels, above the limit of {max_pixels:,}"
                )
            image.verify()  # reads the whole file: a truncated or corrupt image fails here, not in training
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(IMAGE_UNREADABLE, f"{path}: {err}") from err
    return ImageFacts(path, width, height)


def placeholders(texts: list[str]) -> int:
    """`<image>` placeholders in a row's turns."""
    return sum(text.count(IMAGE_PLACEHOLDER) for text in texts)


def check_row_images(
    texts: list[str], refs: list[Any], base_dir: Path, *, max_pixels: int = MAX_IMAGE_PIXELS
) -> list[ImageFacts]:
    """A row's images, resolved and inspected in placeholder order; ImageError for the first
    problem (placeholders and images that do not pair up, or an image that cannot be used)."""
    count = placeholders(texts)
    if count != len(refs):
        raise ImageError(
            IMAGE_COUNT,
            f"{count} {IMAGE_PLACEHOLDER} placeholder(s) in the turns for {len(refs)} image(s); put one "
            f"{IMAGE_PLACEHOLDER} where each image goes, in the order of the images column",
        )
    return [inspect_image(resolve_image(ref, base_dir), max_pixels=max_pixels) for ref in refs]


def openai_content_text(content: Any, refs: list[Any]) -> str:
    """An OpenAI-style message content as text with a placeholder per image part (appending each
    image's reference to `refs`): a string stays as it is; a list of parts joins its text parts
    and puts `<image>` where an `image_url` ({"url": ...}) or `image` part is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ImageError(IMAGE_PART, f"content must be text or a list of parts, got {type(content).__name__}")
    pieces: list[str] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            pieces.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            refs.append(url.get("url") if isinstance(url, dict) else url)
            pieces.append(IMAGE_PLACEHOLDER)
        elif kind == "image":
            refs.append(part.get("image", part.get("path", part.get("url"))))
            pieces.append(IMAGE_PLACEHOLDER)
        else:
            raise ImageError(
                IMAGE_PART, f"content part {index} has type {kind!r}; expected text, image_url or image"
            )
    return "".join(pieces)

"""Reading image and mask files (NIfTI, PNG, JPEG) into numpy arrays, and naming them.

Arrays are returned in the file's own index order: NIfTI ``(X, Y[, Z])`` as stored by nibabel,
PNG/JPEG ``(H, W)`` for grayscale and ``(H, W, 3)`` for colour.

Images and masks are converted differently (:func:`convert_image`, :func:`convert_mask`): an image's
alpha channel is dropped and a palette image becomes the colours it shows (grayscale when its palette
is gray, RGB otherwise); a palette mask keeps its palette indices, which are its labels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

NIFTI_SUFFIXES = (".nii.gz", ".nii")
PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
IMAGE_SUFFIXES = NIFTI_SUFFIXES + PIL_SUFFIXES
#: the mode of every folder pflseg makes (state, logs, data roots, predictions, reports): its user's only
PRIVATE_DIR = 0o700


class ImageFormatError(ValueError):
    """A file that reads but cannot be used as an image or mask (4D, NaN/Inf values); carries what is wrong, the
    fix and a problem code (:func:`pflseg.data.errors.unreadable` reports them instead of "cannot read")."""

    def __init__(self, path: str | Path, problem: str, fix: str, code: str):
        super().__init__(f"{path}: {problem}")
        self.problem, self.fix, self.code = problem, fix, code


def check_dimensions(path: str | Path, shape: tuple) -> None:
    """Raises :class:`ImageFormatError` for a NIfTI of more than 3 axes that are not trailing singletons (a 4D
    series, several channels or time points in one file): pflseg reads one 2D or 3D single-channel volume."""
    if len(shape) > 3 and not all(s == 1 for s in shape[3:]):
        raise ImageFormatError(path, f"{len(shape)}D image of shape {tuple(int(s) for s in shape)}: one 2D or 3D "
                               "volume per file is read", "split it into one 3D file per volume (e.g. one channel or "
                               "time point each: nibabel's four_to_three) or keep the one volume you mean",
                               "image_dimensions")


def check_finite(path: str | Path, array: np.ndarray) -> None:
    """Raises :class:`ImageFormatError` when a floating-point array holds NaN or Inf (training would end with a
    NaN loss, blamed on the learning rate)."""
    if np.issubdtype(array.dtype, np.floating):
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        if bad:
            raise ImageFormatError(path, f"{bad} of {array.size} values are NaN or Inf",
                                   "replace them in the file (e.g. numpy.nan_to_num, or re-export the image) or "
                                   "remove its datalist entry", "non_finite_values")


#: the one PIL decoder a file is read with, by its suffix: a ``.png`` whose content is WebP, TIFF, ... is refused
#: before any other decoder sees it (Pillow's decoders are an attack surface: libwebp's CVE-2023-4863)
PIL_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF"}
#: the largest 2D image read, in pixels (also ``PIL.Image.MAX_IMAGE_PIXELS``): larger is refused before decoding
MAX_PIXELS = 8192 * 8192


def open_image(path: str | Path):
    """``PIL.Image.open(path)`` with only the decoder of the file's suffix (``PIL_FORMATS``) and at most
    ``MAX_PIXELS`` pixels; the image is not decoded yet.

    Raises:
        ImageFormatError: the content is not the format the name says, or the image is too large.
    """
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    suffix = Path(path).suffix.lower()
    fmt = PIL_FORMATS.get(suffix)
    if fmt is None:
        raise ImageFormatError(path, f"'{suffix}' is not a 2D image suffix pflseg reads ({', '.join(PIL_FORMATS)})",
                               "convert it to PNG or NIfTI", "unreadable_file")
    try:
        img = Image.open(path, formats=[fmt])
    except UnidentifiedImageError as exc:
        raise ImageFormatError(path, f"cannot read it as {fmt}, the format its name says (its content is another "
                               "image format, or not an image)", f"convert it to a real {fmt} file (or NIfTI), or "
                               "remove its datalist entry", "unreadable_file") from exc
    except Image.DecompressionBombError as exc:
        raise _too_large(path, str(exc)) from exc
    if img.width * img.height > MAX_PIXELS:
        size = f"{img.width} x {img.height} pixels"
        img.close()
        raise _too_large(path, size)
    return img


def _too_large(path, size: str) -> ImageFormatError:
    return ImageFormatError(path, f"image too large ({size}; at most {MAX_PIXELS} pixels are read)",
                            "downscale it (training reads data.size pixels a side) or remove its datalist entry",
                            "image_too_large")


def is_nifti(path: str | Path) -> bool:
    """True for ``.nii`` / ``.nii.gz`` files."""
    return str(path).lower().endswith(NIFTI_SUFFIXES)


def is_image_file(path: str | Path) -> bool:
    """True for any supported image suffix (case-insensitive)."""
    return str(path).lower().endswith(IMAGE_SUFFIXES)


def file_stem(path: str | Path) -> str:
    """File name without its image suffix (``x.nii.gz`` -> ``x``, ``a.png`` -> ``a``)."""
    name = Path(path).name
    for suffix in IMAGE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


_OTHER_COLOUR_MODES = ("YCbCr", "CMYK", "HSV", "LAB")
LOSSY_SUFFIXES = (".jpg", ".jpeg")


def is_lossy(path: str | Path) -> bool:
    """True for JPEG files, whose masks carry compression noise."""
    return str(path).lower().endswith(LOSSY_SUFFIXES)


def _palette_is_gray(img) -> bool:
    """True when every palette entry of a ``P``/``PA`` image has R == G == B."""
    palette = img.getpalette() or []
    return all(palette[k] == palette[k + 1] == palette[k + 2] for k in range(0, len(palette) - 2, 3))


def _drop_alpha(img):
    """RGBA -> RGB, LA -> L, other colour spaces -> RGB; anything else unchanged."""
    if img.mode in ("RGBA", "RGBa") or img.mode in _OTHER_COLOUR_MODES:
        return img.convert("RGB")
    if img.mode in ("LA", "La"):
        return img.convert("L")
    return img


def convert_image(img):
    """An opened PIL image as the image reader presents it: alpha dropped, palette to gray or RGB.

    16-bit (``I;16``), 32-bit and float gray images are kept as they are.
    """
    if img.mode in ("P", "PA"):
        return img.convert("L" if _palette_is_gray(img) else "RGB")
    return _drop_alpha(img)


def convert_mask(img):
    """An opened PIL mask as the mask reader presents it: palette indices kept, alpha dropped."""
    return img.convert("P") if img.mode == "PA" else _drop_alpha(img)


def pil_to_array(img, mask: bool = False) -> np.ndarray:
    """Converts a PIL image to an array with :func:`convert_image` (or :func:`convert_mask`)."""
    return np.asarray(convert_mask(img) if mask else convert_image(img))


def describe_mode(img) -> tuple[int, str]:
    """Channels an image file gives after :func:`convert_image`, and its mode in words.

    Args:
        img: An opened (not necessarily loaded) PIL image.

    Returns:
        ``(channels, words)``, e.g. ``(3, "RGBA, alpha channel dropped")`` or ``(1, "16-bit gray")``.
    """
    mode = img.mode
    if mode in ("P", "PA"):
        gray = _palette_is_gray(img)
        alpha = ", alpha channel dropped" if mode == "PA" else ""
        return (1, f"palette, converted to gray{alpha}") if gray else (3, f"palette, converted to RGB{alpha}")
    if mode in ("RGBA", "RGBa"):
        return 3, "RGBA, alpha channel dropped"
    if mode in ("LA", "La"):
        return 1, "gray + alpha, alpha channel dropped"
    if mode.startswith("I;16"):
        return 1, "16-bit gray"
    if mode in ("I", "F"):
        return 1, "32-bit integer gray" if mode == "I" else "float gray"
    if mode == "1":
        return 1, "1-bit"
    if mode == "L":
        return 1, "gray"
    if mode == "RGB":
        return 3, "RGB"
    if mode in _OTHER_COLOUR_MODES:
        return 3, f"{mode}, converted to RGB"
    return len(img.getbands()), mode


def image_header(path: str | Path) -> tuple[tuple[int, ...], int, str]:
    """Spatial shape, channels and mode in words of an image file, from its header only.

    Returns:
        ``(shape, channels, words)``: shape ``(H, W)`` for 2D formats (the order of
        :func:`read_array`), the NIfTI spatial shape for NIfTI (channels 1, words "NIfTI").

    Raises:
        Exception: Whatever the reader raises for a missing or corrupt file.
    """
    if is_nifti(path):
        import nibabel as nib

        shape = tuple(int(s) for s in nib.load(str(path)).shape)
        check_dimensions(path, shape)
        shape = shape[:3] if len(shape) > 3 else shape
        return shape, 1, "NIfTI"
    with open_image(path) as img:
        channels, words = describe_mode(img)
        return (img.height, img.width), channels, words


def read_array(path: str | Path, mask: bool = False) -> tuple[np.ndarray, tuple[float, ...] | None]:
    """Reads a whole image file.

    Args:
        path: NIfTI, PNG, JPEG, BMP or TIFF file.
        mask: Read it as a mask (:func:`convert_mask`) rather than an image (:func:`convert_image`).

    Returns:
        ``(array, spacing)``; spacing is the NIfTI pixdim of the spatial axes, None for 2D formats.

    Raises:
        ImageFormatError: A NIfTI of more than 3 (non-singleton) axes, or NaN / Inf values.
        Exception: Whatever the reader raises for a missing, truncated or corrupt file.
    """
    path = Path(path)
    if is_nifti(path):
        import nibabel as nib

        img = nib.load(str(path))
        check_dimensions(path, img.shape)
        data = np.asarray(img.dataobj)
        check_finite(path, data)
        spacing = tuple(float(z) for z in img.header.get_zooms()[: min(3, data.ndim)])
        return data, spacing
    with open_image(path) as img:
        img.load()
        data = pil_to_array(img, mask=mask)
    check_finite(path, data)
    return data, None


def spatial_shape(array: np.ndarray, nifti: bool) -> tuple[int, ...]:
    """Spatial shape: NIfTI keeps all axes (a trailing singleton is dropped); colour PNGs drop the channel."""
    if nifti:
        shape = tuple(array.shape)
        return shape[:3] if len(shape) > 3 and all(s == 1 for s in shape[3:]) else shape
    return tuple(array.shape[:2])


def n_channels(array: np.ndarray, nifti: bool) -> int:
    """Number of image channels: 1 for NIfTI and grayscale, 3 for RGB."""
    return 1 if nifti or array.ndim == 2 else int(array.shape[2])


def mask_plane(array: np.ndarray, nifti: bool) -> np.ndarray:
    """A mask as one integer plane/volume; colour masks use their first channel."""
    if not nifti and array.ndim == 3:
        array = array[..., 0]
    elif nifti and array.ndim > 3:
        array = array.reshape(array.shape[:3])
    return array


def private_dir(folder: str | Path) -> Path:
    """Make ``folder`` and its missing parents with mode ``PRIVATE_DIR`` (0700, whatever the umask); a folder that
    exists already keeps its mode. Returns ``folder``."""
    folder = Path(folder)
    missing = []
    for parent in [folder, *folder.parents]:
        if parent.is_dir():
            break
        missing.append(parent)
    for made in reversed(missing):
        try:
            made.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # made meanwhile by another process (another site, the simulator's next worker)
            continue
        os.chmod(made, PRIVATE_DIR)
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)  # raises what stands in the way (a file of that name)
    return folder

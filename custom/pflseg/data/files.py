"""Reading image and mask files (NIfTI, PNG, JPEG) into numpy arrays, and naming them.

Arrays are returned in the file's own index order: NIfTI ``(X, Y[, Z])`` as stored by nibabel,
PNG/JPEG ``(H, W)`` for grayscale and ``(H, W, 3)`` for colour.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NIFTI_SUFFIXES = (".nii.gz", ".nii")
PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
IMAGE_SUFFIXES = NIFTI_SUFFIXES + PIL_SUFFIXES


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


def pil_to_array(img) -> np.ndarray:
    """Converts a PIL image to an array: palette/index and gray kept, alpha dropped."""
    if img.mode in ("RGBA", "CMYK", "YCbCr", "HSV", "LAB"):
        img = img.convert("RGB")
    elif img.mode == "LA":
        img = img.convert("L")
    return np.asarray(img)


def read_array(path: str | Path) -> tuple[np.ndarray, tuple[float, ...] | None]:
    """Reads a whole image file.

    Args:
        path: NIfTI, PNG, JPEG, BMP or TIFF file.

    Returns:
        ``(array, spacing)``; spacing is the NIfTI pixdim of the spatial axes, None for 2D formats.

    Raises:
        Exception: Whatever the reader raises for a missing, truncated or corrupt file.
    """
    path = Path(path)
    if is_nifti(path):
        import nibabel as nib

        img = nib.load(str(path))
        data = np.asarray(img.dataobj)
        spacing = tuple(float(z) for z in img.header.get_zooms()[: min(3, data.ndim)])
        return data, spacing
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return pil_to_array(img), None


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

"""2D image files are decoded only as the format their name says, and only up to a size (pflseg.data.files)."""

import numpy as np
import pytest
from PIL import Image

from pflseg.data.files import MAX_PIXELS, ImageFormatError, image_header, read_array


@pytest.mark.parametrize("fmt", ["WEBP", "TIFF", "GIF"])
def test_a_png_named_file_holding_another_format_is_refused(fmt, tmp_path):
    """Before: PIL picked the decoder from the content, so a '.png' holding WebP reached libwebp."""
    path = tmp_path / "mask.png"
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(path, format=fmt)
    for read in (image_header, read_array):
        with pytest.raises(ImageFormatError,
                           match=r"mask\.png: cannot read it as PNG, the format its name says") as err:
            read(path)
        assert err.value.code == "unreadable_file" and "real PNG" in err.value.fix


def test_a_real_png_still_reads(tmp_path):
    path = tmp_path / "mask.png"
    Image.fromarray(np.eye(8, dtype=np.uint8)).save(path)
    assert image_header(path)[0] == (8, 8) and read_array(path, mask=True)[0].sum() == 8


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_an_image_beyond_the_pixel_cap_is_refused_before_decoding(tmp_path):
    path = tmp_path / "huge.png"
    Image.new("1", (MAX_PIXELS // 4096 + 1, 4096)).save(path)  # a few kB on disk, > MAX_PIXELS once decoded
    with pytest.raises(ImageFormatError, match=r"huge\.png: image too large") as err:
        read_array(path)
    assert err.value.code == "image_too_large"

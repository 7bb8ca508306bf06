/* Region-of-interest JPEG decode with libjpeg(-turbo): only the rows and columns a crop needs.
 *
 * decode_region(data, eighths, top, left, height, width, out)
 *   decodes the image at eighths/8 of its stored size (the DCT-domain scaling libjpeg does
 *   exactly) and writes rows [top, top + height) x columns [left, left + width) of that
 *   scaled image, as RGB, into `out` (a writable C-contiguous uint8 buffer of
 *   height * width * 3 bytes). Rows above the region are skipped (entropy-decoded only, no
 *   IDCT, upsampling or colour conversion), rows below it are never read, and columns are
 *   limited to the iMCU columns that cover the region (jpeg_crop_scanline).
 *
 * decode_region(..., out, True) writes the rows libjpeg produces straight into `out`, with
 * no copy: rows [top - r, top + height) of the iMCU-aligned columns jpeg_crop_scanline keeps,
 * `stride` pixels each, and returns (r, c, stride): the region is then
 * out.reshape(-1, stride, 3)[r:r + height, c:c + width]. `out` needs room for
 * (height + 16) * (width + 96) * 3 bytes (16 pixels of context each side, iMCU alignment).
 * libjpeg also runs faster asked for several rows per call than for one.
 *
 * Returns True (or the tuple), or False without decoding when the stream is not sound past
 * the region (see stream_sound): the caller then decodes the whole image strictly. Strict like the
 * full decode within what it reads: libjpeg's warnings (corrupt data, data ending early)
 * raise ValueError with libjpeg's message, as every error does. The GIL is released while libjpeg
 * runs, so decoding threads can share a process.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

/* Pixels of context decoded around the region on each side (see decode_region). */
#define MARGIN 16

struct strict_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct strict_error *err = (struct strict_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt or truncated data is an error here */
        struct strict_error *err = (struct strict_error *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

/* Whether the data is a sound JPEG stream past its first scan: it ends with EOI, and every
 * 0xFF in the entropy data is stuffing (00), fill (FF), a restart marker (D0-D7) or a
 * defined marker (C0-FE: tables and scans between the scans of a progressive file). The
 * region decode never reads the rows below the region, so a file cut short or with a stray
 * marker there would pass unseen; such files go to the whole, strict decode instead. */
static int stream_sound(const unsigned char *p, Py_ssize_t n) {
    if (n < 4 || p[n - 2] != 0xFF || p[n - 1] != 0xD9)
        return 0;
    Py_ssize_t i = 2;
    /* header segments up to the first SOS: each FF xx with a 2-byte length */
    while (i + 4 <= n) {
        if (p[i] != 0xFF)
            return 0;
        unsigned char m = p[i + 1];
        if (m == 0xFF) { i++; continue; }
        Py_ssize_t len = ((Py_ssize_t)p[i + 2] << 8) | p[i + 3];
        if (len < 2)
            return 0;
        i += 2 + len;
        if (m == 0xDA)
            break;
    }
    /* the entropy data: only its 0xFF bytes matter, found by memchr (vectorised in libc; a
     * byte-by-byte loop here took 3-4 % of a read task's time) */
    while (i + 1 < n - 2) {
        const unsigned char *f = memchr(p + i, 0xFF, (size_t)(n - 3 - i));
        if (f == NULL)
            break;
        i = f - p;
        unsigned char m = p[i + 1];
        if (m == 0x00 || m == 0xFF || (m >= 0xD0 && m <= 0xD7)) {
            i++;
            continue;
        }
        if (m < 0xC0 || m == 0xD8 || m == 0xD9)
            return 0; /* reserved, a second SOI, or an EOI before the end */
        i += 2;
    }
    return 1;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int eighths, top, left, height, width, direct = 0;
    if (!PyArg_ParseTuple(args, "y*iiiiiw*|p", &data, &eighths, &top, &left, &height, &width,
                          &out, &direct))
        return NULL;
    if (eighths < 1 || eighths > 8 || top < 0 || left < 0 || height < 1 || width < 1 ||
        out.len < (Py_ssize_t)height * width * 3) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "decode_region: bad scale, region or output size");
        return NULL;
    }
    if (!stream_sound((const unsigned char *)data.buf, data.len)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        Py_RETURN_FALSE;
    }
    struct jpeg_decompress_struct cinfo;
    struct strict_error err;
    /* volatile: set after setjmp and read after a longjmp back to it */
    JSAMPLE *volatile row = NULL;
    volatile int failed = 0, outside = 0;
    /* direct mode: the first row, first column and row length (pixels) of the region */
    volatile int row0 = 0, col0 = 0, stride = 0;
    unsigned char *dst = (unsigned char *)out.buf;

    memset(&cinfo, 0, sizeof(cinfo));
    err.message[0] = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;

    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = (unsigned int)eighths;
        cinfo.scale_denom = 8;
        cinfo.dct_method = JDCT_ISLOW;
        cinfo.do_fancy_upsampling = TRUE;
        jpeg_start_decompress(&cinfo);
        if ((JDIMENSION)(top + height) > cinfo.output_height ||
            (JDIMENSION)(left + width) > cinfo.output_width) {
            outside = 1;
        } else {
            /* A margin of context around the region: chroma upsampling at the edge of a
             * cropped or skipped span would otherwise lack its neighbours and differ from
             * the whole decode. */
            int x0 = left > MARGIN ? left - MARGIN : 0;
            int x1 = left + width + MARGIN;
            int y0 = top > MARGIN ? top - MARGIN : 0;
            if ((JDIMENSION)x1 > cinfo.output_width)
                x1 = (int)cinfo.output_width;
            JDIMENSION xoffset = (JDIMENSION)x0, cropped = (JDIMENSION)(x1 - x0);
            jpeg_crop_scanline(&cinfo, &xoffset, &cropped);
            if (direct) {
                /* every row from y0 on, straight into out, several rows per call */
                size_t pitch = (size_t)cropped * 3;
                if ((Py_ssize_t)((size_t)(top + height - y0) * pitch) > out.len) {
                    outside = 3;
                } else {
                    if (y0 > 0)
                        jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
                    while (cinfo.output_scanline < (JDIMENSION)(top + height)) {
                        JSAMPROW rows[16];
                        int y = (int)cinfo.output_scanline, k = 0;
                        for (; k < 16 && y + k < top + height; k++)
                            rows[k] = dst + (size_t)(y + k - y0) * pitch;
                        /* a memory source never suspends: no rows without an error,
                         * but never loop on one */
                        if (jpeg_read_scanlines(&cinfo, rows, (JDIMENSION)k) == 0) {
                            outside = 4;
                            break;
                        }
                    }
                    row0 = top - y0;
                    col0 = left - (int)xoffset;
                    stride = (int)cropped;
                }
            } else if ((row = (JSAMPLE *)malloc((size_t)cropped * 3)) == NULL) {
                outside = 2;
            } else {
                size_t skip = (size_t)(left - (int)xoffset) * 3;
                if (y0 > 0)
                    jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
                for (int y = y0; y < top + height; y++) {
                    JSAMPROW rows[1] = {row};
                    jpeg_read_scanlines(&cinfo, rows, 1);
                    if (y >= top)
                        memcpy(dst + (size_t)(y - top) * width * 3, row + skip,
                               (size_t)width * 3);
                }
            }
        }
    }
    free(row);
    jpeg_destroy_decompress(&cinfo); /* also after an error: frees what libjpeg allocated */
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_Format(PyExc_ValueError, "%s", err.message[0] ? err.message : "JPEG error");
        return NULL;
    }
    if (outside == 1) {
        PyErr_SetString(PyExc_ValueError, "decode_region: region outside the scaled image");
        return NULL;
    }
    if (outside == 2)
        return PyErr_NoMemory();
    if (outside == 3) {
        PyErr_SetString(PyExc_ValueError, "decode_region: output buffer too small");
        return NULL;
    }
    if (outside == 4) {
        PyErr_SetString(PyExc_ValueError, "decode_region: libjpeg returned no rows");
        return NULL;
    }
    if (direct)
        return Py_BuildValue("(iii)", row0, col0, stride);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, eighths, top, left, height, width, out, direct=False): RGB rows "
     "and columns of a JPEG decoded at eighths/8 scale, into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegroi(void) { return PyModule_Create(&module); }

"""Pixels: decode (one entry point for every encoded image), EXIF orientation, crop geometry,
the per-sample random streams and the ImageTransform. Plain numpy/cv2/PIL; imports no other
stage."""

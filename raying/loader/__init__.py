"""What users hold: the Pipeline, batch assembly and prefetch, torch and tf conversion, the
Keras callback. Imports every stage below; nothing below imports it."""

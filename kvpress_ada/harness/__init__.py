"""The harness around the library: the ``kvpress-ada`` command line, the evaluation suite, model
download and conversion, and calibration measurement. It imports the library; the library never
imports it."""

"""Benchmark reports: every benchmark's rows -> validated pandas tables -> tidy CSVs and one
self-contained HTML page with charts (``mlxcel report``).

Modules: ``schema`` (row fields per benchmark), ``load`` (files -> validated tables), ``tables``
(summaries, metrics), ``reference`` (the reference's published numbers), ``baseline`` (comparison
with a previous run), ``plots`` (matplotlib charts), ``html`` (tables and the page), ``build``.
Needs pandas and matplotlib (the ``report`` extra); import ``mlxcel.report.build`` for the API.
"""

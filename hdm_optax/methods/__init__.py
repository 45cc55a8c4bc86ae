"""The algorithm side: the pieces, the iteration core and the variants built from them.

The variants (``_hdm``, ``_hdm_hb``, ``_hdm_agd``, ``_hdm_best``, ``_hdm_auto``,
``_osgm_best``) are optax transformations composed of the pieces (``candidates``,
``learners``, ``trial``, ``hypergradient``, ``acceptance``, ``curvature``,
``schedules``, ``lookahead``); HDM-Best, hdm_auto and OSGM-Best are configurations of
``core.momentum_hdm``. They meet the driver side (``hdm_optax.driver``) only through
the transformation protocol. Every public name is importable as ``hdm_optax.<name>``.
"""

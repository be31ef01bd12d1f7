"""The operator's tools: the ``kvturn`` command (:mod:`.cli`, :mod:`.entry_point`), its
deployment file (:mod:`.config_file`), ``kvturn top`` (:mod:`.top`) and starting engines and
local models (:mod:`.launch`). They use the gateway; the gateway never imports them."""

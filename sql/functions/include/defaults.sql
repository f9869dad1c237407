{{- /* The defaults of the SQL API, each in one place. A Go caller passes NULL for "the
   default"; the functions read these. tests/defaults_test.go reads them back from pg_catalog
   and compares them with docs/sql-api.md. The lock timeout's home is the SET clause of each
   function (include/attributes.sql). */ -}}
{{- define "default_ttl" }}interval '24 hours'{{ end -}}
{{- define "default_lock_timeout" }}2s{{ end -}}
{{- define "default_batch_size" }}1000{{ end -}}
{{- /* max_interval: the longest TTL or lease a call may ask for. Longer is a mistake (a unit
   error), and a key that outlives it would never be cleaned within any retention that
   matters; it also keeps every interval the functions return inside Go's time.Duration. */ -}}
{{- define "max_interval" }}10 years{{ end -}}
{{- /* cleanup_lock: the advisory lock of the cleanup batches ("idem" then "clean" in ASCII;
   idem.CleanupLock in Go), which every batch of a cleaner and of idem_cleanup_all takes for
   its transaction. */ -}}
{{- define "cleanup_lock" }}29665259344325742{{ end -}}

{{- /* The attributes every API function shares: it runs as the owner of schema idem (the
   table is private), pins search_path, and sets its own lock_timeout, restored on return. */ -}}
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '{{ template "default_lock_timeout" }}'

-- The public SQL API of idem, installed (and re-installed) by `server migrate` after the
-- migrations in sql/migrations. Each function lives in its own file.
{{ template "idem_begin.sql" . }}
{{ template "idem_complete.sql" . }}
{{ template "idem_save_final.sql" . }}
{{ template "idem_release.sql" . }}
{{ template "idem_cleanup.sql" . }}

-- Nothing is granted to PUBLIC; the application role may call the five API functions.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idem FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    idem.idem_begin, idem.idem_complete, idem.idem_save_final, idem.idem_release, idem.idem_cleanup
TO "{{.app_role}}";

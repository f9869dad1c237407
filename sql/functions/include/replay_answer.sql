{{- /* replay_answer: idem_begin's answer from the completed row v_row (include/read_key.sql). */ -}}
            attempt := v_row.attempt;
            response_status := v_row.response_status;
            response_headers := v_row.response_headers;
            response_body := v_row.response_body;
            resource_id := v_row.resource_id;
            withheld := v_row.withheld;

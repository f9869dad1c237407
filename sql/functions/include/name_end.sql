{{- /* name_end: v_nul := where the NUL that ends the field name at v_pos of the stored field
   hashes v_blob (a plain copy, not compressed: a substr of a compressed value decompresses it
   up to its offset) is, counted from v_pos; 0 when there is none. Looked for in a window of
   1 KiB, doubled while the name goes on: a cost that follows the name's length, not the rest
   of the form (D242). v_win is an integer: it stays below a bytea's largest size. */ -}}
        v_win := 1024;
        v_nul := position(E'\\x00'::bytea IN substr(v_blob, v_pos, v_win));
        WHILE v_nul = 0 AND v_pos + v_win <= octet_length(v_blob) LOOP
            v_win := v_win * 2;
            v_nul := position(E'\\x00'::bytea IN substr(v_blob, v_pos, v_win));
        END LOOP;

{{- /* not_plain_positive: true when the interval argument (a parameter name) is not really
   positive (include/not_positive.sql) or has a year, month or day part: the test that a
   TTL or a lease passes without a second look, at the cost of not_positive's. Such an
   interval is then tested with not_positive and, when it is positive, given in hours
   (include/in_hours.sql), so that adding it to a timestamp does not depend on the session's
   TimeZone. */ -}}
({{ . }} <= interval '0' OR date_part('year', {{ . }}) <> 0 OR date_part('month', {{ . }}) <> 0
             OR date_part('day', {{ . }}) <> 0 OR {{ . }} - date_trunc('day', {{ . }}) < interval '0')

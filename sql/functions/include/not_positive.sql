{{- /* not_positive: true when the interval argument (a parameter name) is not really
   positive. An interval has three parts (months, days, time) and compares by a total that
   counts a month as 30 days, so '-1 year 361 days' is "greater than zero" yet ends before it
   starts; only an interval whose every part is at least zero, and whose total is above zero,
   is accepted. (date_part, a double, costs less than extract, a numeric.) */ -}}
({{ . }} <= interval '0' OR date_part('year', {{ . }}) < 0 OR date_part('month', {{ . }}) < 0
             OR date_part('day', {{ . }}) < 0 OR {{ . }} - date_trunc('day', {{ . }}) < interval '0')

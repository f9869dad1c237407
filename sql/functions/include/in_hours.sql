{{- /* in_hours: the positive interval argument (a parameter name) without a year, month or day
   part: a month counts 30 days and a day 24 hours, as PostgreSQL compares intervals (so the
   result compares equal to the argument). timestamptz + '1 day' is a calendar day in the
   session's TimeZone, 23 or 25 hours across a change of daylight saving time; timestamptz +
   '1 mon' a calendar month, 28 to 31 days: a key would be kept less than its TTL, a lease end
   before its holder's deadline. */ -}}
(make_interval(hours => ((date_part('year', {{ . }}) * 12 + date_part('month', {{ . }})) * 30
                         + date_part('day', {{ . }}))::integer * 24)
             + ({{ . }} - date_trunc('day', {{ . }})))

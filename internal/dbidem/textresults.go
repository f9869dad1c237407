package dbidem

import (
	"encoding/hex"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// Results read as text. QueryExecModeExec and the simple protocol (PgBouncer in transaction
// mode, a pool without a statement cache) get every result in the text format, written in the
// session's output settings, which a role or a database may set for the whole application
// (ALTER ROLE ... SET DateStyle, bytea_output, extra_float_digits, IntervalStyle). pgx parses
// the default forms only (a timestamp in ISO, a bytea in hex), so the statements here never
// read a timestamp, an interval or a float as text: each comes as whole microseconds, a bigint
// (microsSQL), whose text is the same in every session; and a bytea is read as anyBytea (D231).

// microsSQL is the SQL that turns a timestamptz or interval expression into whole
// microseconds since the epoch (of a duration, its length): a bigint, read alike in both
// formats and every session. fmt.Sprintf(microsSQL, expr).
const microsSQL = `(extract(epoch FROM %s) * 1000000)::bigint`

// microsTime is the time of a microsSQL column; zero for NULL.
func microsTime(us *int64) time.Time {
	if us == nil {
		return time.Time{}
	}
	return time.UnixMicro(*us)
}

// microsDuration is the duration of a microsSQL column; zero for NULL.
func microsDuration(us *int64) time.Duration {
	if us == nil {
		return 0
	}
	return time.Duration(*us) * time.Microsecond
}

// anyBytea is a bytea column read in either format: binary, or text in the session's
// bytea_output, hex ("\x...") or escape. pgx's own reader of the text format knows hex only: a
// role with bytea_output = 'escape' made every replay of a stored body fail in
// QueryExecModeExec (D231). Scan into (*anyBytea)(&b) for a b []byte.
type anyBytea []byte

// ScanBytes reads the binary format (pgtype.BytesScanner); src is the driver's buffer, so it
// is copied.
func (b *anyBytea) ScanBytes(src []byte) error {
	if src == nil {
		*b = nil
		return nil
	}
	*b = append(make([]byte, 0, len(src)), src...)
	return nil
}

// ScanText reads the text format (pgtype.TextScanner), which pgx offers to a TextScanner before
// its own bytea reader.
func (b *anyBytea) ScanText(v pgtype.Text) error {
	if !v.Valid {
		*b = nil
		return nil
	}
	out, err := decodeByteaText(v.String)
	if err != nil {
		return err
	}
	*b = out
	return nil
}

var errByteaText = errors.New("dbidem: a bytea in neither hex nor escape format")

// decodeByteaText decodes PostgreSQL's text output of a bytea: "\x" and two hex digits a
// byte (bytea_output = 'hex'), or the escape format, where a backslash is written "\\", a byte
// that is not printable ASCII "\ooo" in octal, and every other byte as itself.
func decodeByteaText(s string) ([]byte, error) {
	if len(s) >= 2 && s[0] == '\\' && s[1] == 'x' {
		out := make([]byte, (len(s)-2)/2)
		if _, err := hex.Decode(out, []byte(s[2:])); err != nil {
			return nil, errByteaText
		}
		return out, nil
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		switch {
		case i+1 < len(s) && s[i+1] == '\\':
			out = append(out, '\\')
			i++
		case i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) && s[i+1] <= '3':
			out = append(out, (s[i+1]-'0')<<6|(s[i+2]-'0')<<3|(s[i+3]-'0'))
			i += 3
		default:
			return nil, errByteaText
		}
	}
	return out, nil
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

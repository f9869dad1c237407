package idemhttp

import (
	stdjson "encoding/json"
	"errors"
	"math/big"
	"strconv"
	"strings"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// decodeOptions are DecodeJSON's: strict (unknown members refused, names matched by exact
// case), and the Go types that handlers written for encoding/json take numbers into, which the
// v2 semantics alone refuse or cannot read from the canonical text: encoding/json's Number (the
// number's canonical text, or a string that is a number, as encoding/json takes), time.Duration
// (an integer of nanoseconds, as encoding/json reads it) and math/big's Int (an integer, also in
// the exponent form that the canonical text gives integers from 10^21 on: 1e+21).
var decodeOptions = json.JoinOptions(
	json.RejectUnknownMembers(true),
	json.MatchCaseInsensitiveNames(false),
	json.WithUnmarshalers(json.JoinUnmarshalers(
		json.UnmarshalFromFunc(decodeNumber),
		json.UnmarshalFromFunc(decodeDuration),
		json.UnmarshalFromFunc(decodeBigInt),
	)),
)

// maxBigIntDigits bounds the digits of an integer written with an exponent (1e+999999999 is
// 13 bytes of body): past it the body is refused rather than expanded.
const maxBigIntDigits = 10000

var errNotInteger = errors.New("not an integer")

// numberText reads the next value when it is a JSON number and returns its text. For null it
// returns errors.ErrUnsupported, which hands the value to the default (the zero value, a nil
// pointer); anything else is an error.
func numberText(dec *jsontext.Decoder) (string, error) {
	switch dec.PeekKind() {
	case 'n':
		return "", errors.ErrUnsupported
	case '0':
		tok, err := dec.ReadToken()
		if err != nil {
			return "", err
		}
		return tok.String(), nil
	}
	return "", errors.New("want a JSON number")
}

// decodeNumber reads a number's canonical text, or, as encoding/json does, a string that is a
// valid JSON number (as sent; a map's keys too).
func decodeNumber(dec *jsontext.Decoder, n *stdjson.Number) error {
	if dec.PeekKind() == '"' {
		tok, err := dec.ReadToken()
		if err != nil {
			return err
		}
		s := tok.String()
		if s != strings.TrimSpace(s) || !stdjson.Valid([]byte(s)) || !isNumber(s) {
			return errors.New("want a JSON number in the string")
		}
		*n = stdjson.Number(s)
		return nil
	}
	t, err := numberText(dec)
	if err == nil {
		*n = stdjson.Number(t)
	}
	return err
}

// isNumber tells whether valid JSON text s is a number: it starts with a digit or a minus.
func isNumber(s string) bool { return s != "" && (s[0] == '-' || s[0] >= '0' && s[0] <= '9') }

func decodeDuration(dec *jsontext.Decoder, d *time.Duration) error {
	t, err := numberText(dec)
	if err != nil {
		return err
	}
	ns, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return errors.New("a duration is an integer of nanoseconds")
	}
	*d = time.Duration(ns)
	return nil
}

func decodeBigInt(dec *jsontext.Decoder, z *big.Int) error {
	t, err := numberText(dec)
	if err != nil {
		return err
	}
	digits, exp := t, 0
	if i := strings.IndexByte(t, 'e'); i >= 0 {
		digits = t[:i]
		if exp, err = strconv.Atoi(strings.TrimPrefix(t[i+1:], "+")); err != nil {
			return errNotInteger
		}
	}
	if i := strings.IndexByte(digits, '.'); i >= 0 {
		exp -= len(digits) - i - 1
		digits = digits[:i] + digits[i+1:]
	}
	if exp < 0 {
		return errNotInteger // the canonical text has no trailing zeros after a point
	}
	if len(strings.TrimPrefix(digits, "-"))+exp > maxBigIntDigits {
		return errors.New("an integer of more than 10000 digits")
	}
	if _, ok := z.SetString(digits+strings.Repeat("0", exp), 10); !ok {
		return errNotInteger
	}
	return nil
}

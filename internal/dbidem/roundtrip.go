package dbidem

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
)

// roundTrips tells whether raw, the JSON of v, gives v back, as a replay (a Do or DoLease
// result) or a later attempt (a step's value) decodes it into T: nil when it does, else why
// not. Stored as it is, such a value would commit with the work and then fail every replay
// (a type whose UnmarshalJSON refuses its own JSON, an error held in an interface) or replay
// another value (a large integer in an interface, which decodes as a float64, or a struct
// whose fields are not exported, which encodes as {}). The JSON that what decodes encodes
// to must be the same JSON: byte for byte, or the same values once both are read with their
// numbers as written (objects whose members come back in another order, as a map's do).
func roundTrips[T any](v T, raw []byte) error {
	if dropsEverything(v, raw) {
		return fmt.Errorf("encodes as {} (%T exports none of its fields): a replay would give its zero value", v)
	}
	var back T
	if err := json.Unmarshal(raw, &back); err != nil {
		return fmt.Errorf("does not decode back into %T, so every replay would fail: %w", v, err)
	}
	again, err := json.Marshal(back)
	if err != nil {
		return fmt.Errorf("decodes into a %T that does not encode again: %w", back, err)
	}
	if bytes.Equal(again, raw) || sameJSON(again, raw) {
		return nil
	}
	return fmt.Errorf("does not come back the same from its JSON into %T (a number in an interface decodes as a float64, "+
		"which keeps 53 bits; a custom MarshalJSON or UnmarshalJSON may change it): a replay would give another value", v)
}

// sameJSON tells whether a and b are the same JSON values, numbers compared as written.
func sameJSON(a, b []byte) bool {
	va, errA := decodeNumbers(a)
	vb, errB := decodeNumbers(b)
	return errA == nil && errB == nil && reflect.DeepEqual(va, vb)
}

func decodeNumbers(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("trailing data")
	}
	return v, nil
}

// dropsEverything tells whether v, a struct with fields (or a pointer or interface to one)
// that is not its zero value, encodes as {}: none of its fields is exported (or each is
// tagged "-"), and its JSON says nothing of it.
func dropsEverything(v any, raw []byte) bool {
	if string(raw) != "{}" {
		return false
	}
	r := reflect.ValueOf(v)
	for r.IsValid() && (r.Kind() == reflect.Pointer || r.Kind() == reflect.Interface) {
		if r.IsNil() {
			return false
		}
		r = r.Elem()
	}
	return r.IsValid() && r.Kind() == reflect.Struct && r.NumField() > 0 && !r.IsZero()
}

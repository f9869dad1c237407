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
// numbers as written (objects whose members come back in another order, as a map's do). back
// is what a replay decodes: the value every caller gets (D269).
func roundTrips[T any](v T, raw []byte) (back T, err error) {
	if dropsEverything(v, raw) {
		return back, fmt.Errorf("encodes as {} (%T has no field JSON writes: none is exported): a replay would give its zero value", v)
	}
	if err := json.Unmarshal(raw, &back); err != nil {
		return back, fmt.Errorf("does not decode back into %T, so every replay would fail: %w", v, err)
	}
	again, err := json.Marshal(back)
	if err != nil {
		return back, fmt.Errorf("decodes into a %T that does not encode again: %w", back, err)
	}
	if bytes.Equal(again, raw) || sameJSON(again, raw) {
		return back, nil
	}
	return back, fmt.Errorf("does not come back the same from its JSON into %T (a number in an interface decodes as a float64, "+
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

// dropsEverything tells whether v, a value of a struct type that JSON can say nothing of (no
// exported field that encoding/json writes, none in an embedded struct, no MarshalJSON),
// is not its zero value and encodes as {}: its JSON drops everything it holds. A struct with
// fields JSON writes is never such, even when its JSON is {} (empty omitempty fields: the
// replay decodes the same {} to the same JSON).
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
	return r.IsValid() && r.Kind() == reflect.Struct && r.NumField() > 0 && !r.IsZero() && !jsonWrites(r.Type())
}

var marshalerType = reflect.TypeFor[json.Marshaler]()

// jsonWrites tells whether encoding/json writes anything of struct type t: a MarshalJSON, or
// an exported field not tagged "-", or one in an embedded struct.
func jsonWrites(t reflect.Type) bool {
	if t.Implements(marshalerType) || reflect.PointerTo(t).Implements(marshalerType) {
		return true
	}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Tag.Get("json") == "-" {
			continue
		}
		if f.IsExported() {
			return true
		}
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && ft.Kind() == reflect.Struct && jsonWrites(ft) {
			return true
		}
	}
	return false
}

package canon

import (
	"encoding/binary"
	"unicode/utf16"
	"unicode/utf8"
)

func hexDigit(c byte) (rune, bool) {
	switch {
	case c >= '0' && c <= '9':
		return rune(c - '0'), true
	case c >= 'a' && c <= 'f':
		return rune(c-'a') + 10, true
	case c >= 'A' && c <= 'F':
		return rune(c-'A') + 10, true
	}
	return 0, false
}

func (p *parser) hex4() (rune, error) {
	if p.pos+4 > len(p.data) {
		return 0, p.fail("short \\u escape")
	}
	var r rune
	for _, c := range p.data[p.pos : p.pos+4] {
		d, ok := hexDigit(c)
		if !ok {
			return 0, p.fail("invalid \\u escape")
		}
		r = r<<4 | d
	}
	p.pos += 4
	return r, nil
}

// plain8 tells whether none of the eight bytes of w is '"', '\\', below 0x20 or above 0x7F:
// the bytes a string copies as they are. (x - n*0x01..) &^ x & 0x80.. is non-zero exactly
// when some byte of x is below n (n <= 0x80); a byte equal to b is a zero byte of x ^ b*0x01...
func plain8(w uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	q, bs := w^(ones*'"'), w^(ones*'\\')
	return (w|(w-ones*0x20)&^w|(q-ones)&^q|(bs-ones)&^bs)&highs == 0
}

// validRune is the length of the valid UTF-8 sequence that b starts with (a lead byte), or 0
// when it is not valid (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
// It checks what utf8.DecodeRune checks without building the rune.
func validRune(b []byte) int {
	switch c := b[0]; {
	case c < 0xC2:
		return 0
	case c < 0xE0:
		return sequence(b, 2, 0x80, 0xBF)
	case c == 0xE0:
		return sequence(b, 3, 0xA0, 0xBF) // not overlong
	case c == 0xED:
		return sequence(b, 3, 0x80, 0x9F) // not a surrogate
	case c < 0xF0:
		return sequence(b, 3, 0x80, 0xBF)
	case c == 0xF0:
		return sequence(b, 4, 0x90, 0xBF) // not overlong
	case c < 0xF4:
		return sequence(b, 4, 0x80, 0xBF)
	case c == 0xF4:
		return sequence(b, 4, 0x80, 0x8F) // not past U+10FFFF
	}
	return 0
}

// sequence is n when b holds a lead byte, a second byte from lo to hi and n-2 more
// continuation bytes, else 0.
func sequence(b []byte, n int, lo, hi byte) int {
	if len(b) < n || b[1] < lo || b[1] > hi {
		return 0
	}
	for _, x := range b[2:n] {
		if x&0xC0 != 0x80 {
			return 0
		}
	}
	return n
}

// string decodes the JSON string at p.pos (which is '"'). A string without escapes is
// returned as a slice of the input.
func (p *parser) string() (span, error) {
	p.pos++
	start := p.pos
	// Fast path: no escapes, so nothing to copy. Eight bytes at a time while none of them is
	// a quote, a backslash, a control character or part of a multi-byte character.
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		if c < utf8.RuneSelf && p.pos+8 <= len(p.data) && plain8(binary.LittleEndian.Uint64(p.data[p.pos:])) {
			p.pos += 8
			continue
		}
		if c == '"' {
			p.pos++
			return span{int32(start), int32(p.pos - 1 - start)}, nil
		}
		if c == '\\' || c < 0x20 {
			break
		}
		if c >= 0xC2 && c < 0xE0 && p.pos+1 < len(p.data) && p.data[p.pos+1]&0xC0 == 0x80 {
			p.pos += 2 // two bytes, checked here (validRune is not inlined)
			continue
		}
		if c >= utf8.RuneSelf {
			size := validRune(p.data[p.pos:])
			if size == 0 {
				return span{}, p.fail("invalid UTF-8")
			}
			p.pos += size
			continue
		}
		p.pos++
	}
	escaped := false
	arenaStart := len(p.arena)
	p.arena = append(p.arena, p.data[start:p.pos]...)
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			if !escaped {
				p.arena = p.arena[:arenaStart]
				return span{int32(start), int32(p.pos - 1 - start)}, nil
			}
			return span{int32(-arenaStart - 1), int32(len(p.arena) - arenaStart)}, nil
		case c < 0x20:
			return span{}, p.fail("control character in a string")
		case c >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return span{}, p.fail("invalid UTF-8")
			}
			p.arena = append(p.arena, p.data[p.pos:p.pos+size]...)
			p.pos += size
		case c != '\\':
			p.arena = append(p.arena, c)
			p.pos++
		default:
			escaped = true
			p.pos++
			if p.pos >= len(p.data) {
				return span{}, p.fail("unexpected end in an escape")
			}
			e := p.data[p.pos]
			p.pos++
			switch e {
			case '"', '\\', '/':
				p.arena = append(p.arena, e)
			case 'b':
				p.arena = append(p.arena, '\b')
			case 'f':
				p.arena = append(p.arena, '\f')
			case 'n':
				p.arena = append(p.arena, '\n')
			case 'r':
				p.arena = append(p.arena, '\r')
			case 't':
				p.arena = append(p.arena, '\t')
			case 'u':
				r, err := p.hex4()
				if err != nil {
					return span{}, err
				}
				if utf16.IsSurrogate(r) {
					if r >= 0xDC00 || p.pos+2 > len(p.data) || p.data[p.pos] != '\\' || p.data[p.pos+1] != 'u' {
						return span{}, p.fail("lone surrogate")
					}
					p.pos += 2
					lo, err := p.hex4()
					if err != nil {
						return span{}, err
					}
					if lo < 0xDC00 || lo > 0xDFFF {
						return span{}, p.fail("lone surrogate")
					}
					r = utf16.DecodeRune(r, lo)
				}
				if r == 0 {
					p.nul = true
				}
				p.arena = utf8.AppendRune(p.arena, r)
			default:
				return span{}, p.fail("invalid escape")
			}
		}
	}
	return span{}, p.fail("unterminated string")
}

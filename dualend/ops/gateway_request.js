// The gateway's check of a generate request's JSON (nginx njs), before it reaches tritonserver.
// tritonserver 2.51's HTTP frontend answers a wrong JSON type with a 500 that names no field, wraps an
// integer past INT32 (10^12 arrives as -727379968) and passes an unknown field on as a parameter, so a
// misspelt `temprature` would be ignored. Values of the right type are checked by the preprocessing
// model (ranges, text), as for gRPC. INPUTS (name -> {type, many, required}) is written above this
// file by dualend.ops.gateway from the ensemble's config.

// Past 2^53 a JSON number is no longer exact here, so a UINT64's upper bound is checked on its digits
// as written (tritonserver reads them exactly), in textProblem.
const INTEGER_RANGES = {TYPE_INT32: [-2147483648, 2147483647], TYPE_UINT64: [0, Infinity]};
const UINT64_MAX = '18446744073709551615';

function has(object, name) {
    return Object.prototype.hasOwnProperty.call(object, name);  // not `constructor` and the like
}

const REQUIRED = Object.keys(INPUTS).filter((name) => INPUTS[name].required);
const NAMES = Object.keys(INPUTS).sort().join(', ');

function shown(value) {
    const text = JSON.stringify(value);
    return text.length > 40 ? text.slice(0, 37) + '...' : text;
}

function valueProblem(name, type, value) {
    if (type === 'TYPE_STRING') {
        return typeof value === 'string' ? null : `${name} must be a string, got ${shown(value)}`;
    }
    if (type === 'TYPE_BOOL') {
        return typeof value === 'boolean' ? null : `${name} must be true or false, got ${shown(value)}`;
    }
    if (type === 'TYPE_FP32') {
        return typeof value === 'number' ? null : `${name} must be a number, got ${shown(value)}`;
    }
    const range = INTEGER_RANGES[type];
    if (!range) {
        return `${name} has a type this gateway does not check (${type})`;
    }
    if (!Number.isInteger(value) || value < range[0] || value > range[1]) {
        return outOfRange(name, type, shown(value));
    }
    return null;
}

function outOfRange(name, type, got) {
    const top = type === 'TYPE_UINT64' ? UINT64_MAX : INTEGER_RANGES[type][1];
    return `${name} must be an integer from ${INTEGER_RANGES[type][0]} to ${top} (${type.slice(5)}), got ${got}`;
}

// JSON.parse keeps the last of repeated keys, reads 4.0 as 4 and decodes escapes in keys;
// tritonserver reads the first of repeated keys and refuses 4.0 for an integer input with a 500. So
// the keys are also read from the text as sent: every string token followed by a colon (the body is
// a flat object of inputs by now, and outside strings valid JSON has no quote).
function textProblem(text) {
    const token = /"((?:[^"\\]|\\[\s\S])*)"(\s*:[\s\[]*[-+0-9.eE]*)?/g;
    const counts = {};
    let match;
    while ((match = token.exec(text)) !== null) {
        const name = match[1];
        if (match[2] === undefined) {
            continue;  // a string value
        }
        if (name.indexOf('\\') >= 0) {
            return `field names must be written without escapes, got "${name.slice(0, 40)}"`;
        }
        counts[name] = (counts[name] || 0) + 1;
        const number = match[2].slice(match[2].indexOf(':') + 1).replace(/^[\s\[]*/, '');
        const type = has(INPUTS, name) ? INPUTS[name].type : null;
        if (has(INTEGER_RANGES, type) && /[.eE]/.test(number)) {
            return `${name} must be an integer written without a fraction or exponent`;
        }
        const digits = number.replace(/^\+?0*/, '');
        if (type === 'TYPE_UINT64' && (digits.length > UINT64_MAX.length
                || (digits.length === UINT64_MAX.length && digits > UINT64_MAX))) {
            return outOfRange(name, type, number.slice(0, 40));
        }
    }
    const outside = text.replace(/"(?:[^"\\]|\\[\s\S])*"/g, '""');  // what is not in a string
    const numbers = outside.match(/[-+.0-9][-+0-9.eE]*/g) || [];
    for (let i = 0; i < numbers.length; i++) {  // njs reads 04, .5, 1. and 1e999 (as Infinity); tritonserver does not
        if (!/^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?$/.test(numbers[i]) || !isFinite(Number(numbers[i]))) {
            return `${numbers[i].slice(0, 40)} is not a JSON number tritonserver reads (no leading zeros, `
                + 'digits on both sides of a point, within the float range)';
        }
    }
    const repeated = Object.keys(counts).filter((name) => counts[name] > 1);
    return repeated.length ? `${repeated[0]} appears ${counts[repeated[0]]} times in the body; send it once` : null;
}

// tritonserver's JSON parser answers a \uD800-\uDBFF escape without its low half with a 500. Each
// backslash escape is read in turn, so an escaped backslash before "u" is not taken for one.
function surrogateProblem(text) {
    const escape = /\\(?:u([0-9a-fA-F]{4})|[\s\S])/g;
    let match;
    let highEnd = -1;  // where a high surrogate's escape ended, while its low half is awaited
    while ((match = escape.exec(text)) !== null) {
        const unit = match[1] ? parseInt(match[1], 16) : -1;
        const low = unit >= 0xDC00 && unit <= 0xDFFF;
        if ((highEnd >= 0 && !(low && match.index === highEnd)) || (highEnd < 0 && low)) {
            break;
        }
        highEnd = unit >= 0xD800 && unit <= 0xDBFF ? escape.lastIndex : -1;
    }
    if (match === null && highEnd < 0) {
        return null;
    }
    const at = highEnd >= 0 ? highEnd - 6 : match.index;  // the high half waiting, else the lone low one
    return `the body holds an unpaired UTF-16 surrogate escape (${text.slice(at, at + 6)}), `
        + 'which is no character: a character past U+FFFF is written as two escapes, high then low';
}

function bodyProblem(body) {
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
        return `the request body must be a JSON object of inputs, got ${shown(body)}`;
    }
    const names = Object.keys(body);
    for (let i = 0; i < names.length; i++) {  // njs 0.7 has no for...of
        const name = names[i];
        const input = has(INPUTS, name) ? INPUTS[name] : null;
        if (!input) {
            return `unknown field '${name}'; the inputs are ${NAMES}`;
        }
        const values = Array.isArray(body[name]) ? body[name] : [body[name]];
        if (!input.many && values.length !== 1) {
            return `${name} takes one value, got ${values.length}`;
        }
        for (let j = 0; j < values.length; j++) {
            const problem = valueProblem(name, input.type, values[j]);
            if (problem) {
                return problem;
            }
        }
    }
    const missing = REQUIRED.filter((name) => !has(body, name));
    return missing.length ? `missing required field(s): ${missing.join(', ')}` : null;
}

// tritonserver would run a whole generation and then answer /generate with an error, as a 200.
function routeProblem(uri, body) {
    return [].concat(body.stream)[0] === true && !/\/generate_stream$/.test(uri)  // true or [true]
        ? 'stream: true streams only on the generate_stream route; /generate answers once (drop stream or change route)'
        : null;
}

function check(r) {
    let body;
    try {
        body = JSON.parse(r.requestText || '');
    } catch (error) {
        body = undefined;
    }
    const problem = body === undefined ? 'the request body is not valid JSON'
        : bodyProblem(body) || textProblem(r.requestText) || surrogateProblem(r.requestText)
        || routeProblem(r.uri, body);
    if (problem) {
        r.headersOut['Content-Type'] = 'application/json';
        r.return(400, JSON.stringify({error: problem}));
        return;
    }
    r.internalRedirect('@triton');
}

// The client an `Authorization: Bearer <key>` header names: CLIENTS (sha256 of the key, hex -> name)
// is written above this file by dualend.ops.gateway, so no file of the gateway holds a key; the
// header is matched exactly (nginx's map would ignore case). Without keys, everyone is `anonymous`.
const crypto = require('crypto');

function client(r) {
    if (CLIENTS === null) {
        return 'anonymous';
    }
    const header = r.headersIn.Authorization || '';
    if (!header.startsWith('Bearer ')) {
        return '';
    }
    const digest = crypto.createHash('sha256').update(header.slice(7)).digest('hex');
    return has(CLIENTS, digest) ? CLIENTS[digest] : '';
}

export default {check, client};

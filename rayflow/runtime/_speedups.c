/* rayflow.runtime._speedups: the per-record loops of a keyed reduce and of a map, in C.
 *
 * reduce_columns() does what the loop rayflow.runtime.reduce_loop compiles in Python
 * does, step for step and in the same order (the same calls of the user's function, the
 * same state, the same values emitted, the same value handed back where it stops, the
 * same exceptions), without the interpreter's cost per step. map_columns() is a map's
 * loop by the same rules (rayflow.runtime.map_loop). Both are optional: where they were
 * not built, or RAYFLOW_NO_SPEEDUPS is set, the Python loop or the record path runs
 * instead (rayflow.runtime.speedups).
 *
 * Every object kept across a step that may run Python code (the user's function, set_key,
 * table_of_key, a key's __hash__ or __eq__) is held by a strong reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef Py_GIL_DISABLED
#error "the loop reads borrowed references under the GIL; the free-threaded build uses the Python loop"
#endif

/* the most input or output columns a loop takes (more: the Python loop) */
#define MAX_COLUMNS 64

/* The version of these functions' arguments and results: rayflow.runtime.speedups loads
 * a module built from another version (an older build left in place) as none. */
#define SPEEDUPS_ABI 4

/* "get", interned at import */
static PyObject *get_name;

PyDoc_STRVAR(reduce_columns_doc,
"reduce_columns(tables, table_of_key, state_name, call, set_key, lists, where, inputs,\n"
"               key_index, names, checks, columns, end) -> (key, end or value)\n"
"\n"
"The loop of rayflow.runtime.reduce_loop: for each row of ``columns`` (a tuple of lists,\n"
"one per name of ``inputs``) builds the record {inputs[j]: columns[j][row]}, sets the\n"
"current key (``set_key``, None for none), finds the key's table (``tables.get(key)``,\n"
"else ``table_of_key(key, state_name)``), reduces (``call(previous, record)``, or keeps\n"
"the record first) and stores the value, and appends the value's ``names`` to ``lists``\n"
"when it is a plain dict of exactly those keys whose values pass ``checks`` (per column\n"
"a type the value must be exactly, or None; None always passes). Returns (last key,\n"
"``end``) when every row went so, else (key, value) at the first value that did not.\n"
"``where`` (a list of two) gets the last key and the state's value before the last call.");

static int
bad_argument(const char *what)
{
    PyErr_Format(PyExc_TypeError, "reduce_columns: %s", what);
    return -1;
}

/* Checks the arguments both loops share. */
static int
check_columns(PyObject *lists, PyObject *inputs, PyObject *names, PyObject *checks,
              PyObject *columns)
{
    if (!PyTuple_CheckExact(inputs) || !PyTuple_CheckExact(names) || !PyTuple_CheckExact(checks)
        || !PyTuple_CheckExact(columns))
        return bad_argument("inputs, names, checks and columns must be tuples");
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(names);
    if (n_in < 1 || n_in > MAX_COLUMNS || PyTuple_GET_SIZE(columns) != n_in)
        return bad_argument("one column per input name, at most 64");
    if (n_out < 1 || n_out > MAX_COLUMNS || PyTuple_GET_SIZE(checks) != n_out)
        return bad_argument("one check per output name, at most 64");
    if (!PyList_CheckExact(lists) || PyList_GET_SIZE(lists) != n_out)
        return bad_argument("lists must be a list of one list per output name");
    for (Py_ssize_t j = 0; j < n_in; j++) {
        if (!PyList_CheckExact(PyTuple_GET_ITEM(columns, j)))
            return bad_argument("columns must be lists");
    }
    for (Py_ssize_t i = 0; i < n_out; i++) {
        PyObject *check = PyTuple_GET_ITEM(checks, i);
        if (check != Py_None && !PyType_Check(check))
            return bad_argument("a check is a type or None");
        if (!PyList_CheckExact(PyList_GET_ITEM(lists, i)))
            return bad_argument("lists must be a list of lists");
    }
    return 0;
}

/* Appends the values of ``value`` to ``outs`` (one list per name of ``names``) when it is
 * a plain dict of exactly those keys whose values pass ``checks`` (and, with ``str_keys``,
 * whose keys are all str): 1 when it did, 0 when ``value`` is not such a record (nothing
 * appended), -1 on an error. As the Python loop: every key is looked up first (a KeyError,
 * also one a key's __eq__ raises, means "not such a record"), then the types are checked,
 * then the values appended. */
static int
take_apart(PyObject *value, PyObject *names, PyObject *checks, PyObject **outs, int str_keys)
{
    Py_ssize_t n_out = PyTuple_GET_SIZE(names);
    PyObject *values[MAX_COLUMNS];
    if (!PyDict_CheckExact(value) || PyDict_GET_SIZE(value) != n_out)
        return 0;
    if (str_keys) {
        /* as the record path: a key that is not a str is no column name (and no key's
         * __eq__ runs below) */
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(value, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k))
                return 0;
        }
    }
    int fits = 1, status = 0;
    Py_ssize_t taken = 0;
    for (; taken < n_out; taken++) {
        PyObject *v = PyDict_GetItemWithError(value, PyTuple_GET_ITEM(names, taken));
        if (v == NULL) {
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                    status = -1;
                    goto release;
                }
                PyErr_Clear();
            }
            fits = 0;
            goto release;
        }
        Py_INCREF(v); /* a key's __eq__ may change the dict while the next is looked up */
        values[taken] = v;
    }
    for (Py_ssize_t i = 0; i < n_out; i++) {
        PyObject *check = PyTuple_GET_ITEM(checks, i);
        if (check != Py_None && (PyObject *)Py_TYPE(values[i]) != check && values[i] != Py_None) {
            fits = 0;
            goto release;
        }
    }
    for (Py_ssize_t i = 0; i < n_out; i++) {
        if (PyList_Append(outs[i], values[i]) < 0) {
            status = -1;
            goto release;
        }
    }
    status = 1;
release:
    for (Py_ssize_t i = 0; i < taken; i++)
        Py_DECREF(values[i]);
    return status < 0 ? -1 : (fits ? status : 0);
}

/* Takes row ``row`` of every column into ``items`` (strong references), as zip() takes a
 * row's items before the loop's body runs: 1, or 0 where a column has no such row (the
 * function may have reached a column and emptied it; zip() then ends there). */
static int
take_row(PyObject *columns, Py_ssize_t row, PyObject **items)
{
    Py_ssize_t n_in = PyTuple_GET_SIZE(columns);
    for (Py_ssize_t j = 0; j < n_in; j++) {
        if (row >= PyList_GET_SIZE(PyTuple_GET_ITEM(columns, j)))
            return 0;
    }
    for (Py_ssize_t j = 0; j < n_in; j++) {
        items[j] = PyList_GET_ITEM(PyTuple_GET_ITEM(columns, j), row);
        Py_INCREF(items[j]);
    }
    return 1;
}

static void
release(PyObject **objects, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(objects[i]);
}

/* Strong references to the lists of ``lists`` in ``outs``, as the Python loop's bound
 * appends hold them (emptying ``lists`` leaves them alive); released with release(). */
static void
hold_outs(PyObject *lists, PyObject **outs)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lists); i++) {
        outs[i] = PyList_GET_ITEM(lists, i);
        Py_INCREF(outs[i]);
    }
}

/* {inputs[j]: items[j]} as a new dict; NULL on an error */
static PyObject *
record_of(PyObject *inputs, PyObject **items)
{
    PyObject *record = PyDict_New();
    if (record == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(inputs); j++) {
        if (PyDict_SetItem(record, PyTuple_GET_ITEM(inputs, j), items[j]) < 0) {
            Py_DECREF(record);
            return NULL;
        }
    }
    return record;
}

/* table.get(key) as a new reference (None where absent); NULL on an error */
static PyObject *
table_get(PyObject *table, PyObject *key)
{
    PyObject *value;
    if (PyDict_CheckExact(table)) {
        value = PyDict_GetItemWithError(table, key);
        if (value == NULL) {
            if (PyErr_Occurred())
                return NULL;
            value = Py_None;
        }
        Py_INCREF(value);
        return value;
    }
    return PyObject_CallMethodObjArgs(table, get_name, key, NULL);
}

static PyObject *
reduce_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "reduce_columns takes 13 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *tables = args[0], *table_of_key = args[1], *state_name = args[2];
    PyObject *call = args[3], *set_key = args[4], *lists = args[5], *where = args[6];
    PyObject *inputs = args[7], *names = args[9], *checks = args[10], *columns = args[11];
    PyObject *end = args[12];
    if (check_columns(lists, inputs, names, checks, columns) < 0)
        return NULL;
    if (!PyDict_CheckExact(tables)) {
        bad_argument("tables must be a dict");
        return NULL;
    }
    if (!PyList_CheckExact(where) || PyList_GET_SIZE(where) != 2) {
        bad_argument("where must be a list of two");
        return NULL;
    }
    Py_ssize_t key_index = PyLong_AsSsize_t(args[8]);
    if (key_index == -1 && PyErr_Occurred())
        return NULL;
    if (key_index < 0 || key_index >= PyTuple_GET_SIZE(inputs)) {
        bad_argument("key_index out of range");
        return NULL;
    }

    PyObject *key = Py_None, *previous = Py_None, *result = NULL;
    PyObject *outs[MAX_COLUMNS], *items[MAX_COLUMNS];
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(names);
    Py_INCREF(key);
    Py_INCREF(previous);
    hold_outs(lists, outs);

    /* the record of the row before, released once this row's is built (as the Python
     * loop's ``record`` holds it) */
    PyObject *held = NULL;
    for (Py_ssize_t row = 0; take_row(columns, row, items); row++) {
        /* key = i<key_index>; record = {inputs[0]: i0, ...} */
        Py_INCREF(items[key_index]);
        Py_SETREF(key, items[key_index]);
        PyObject *record = record_of(inputs, items);
        release(items, n_in);
        Py_CLEAR(held);
        if (record == NULL)
            goto done;
        if (set_key != Py_None) {
            PyObject *r = PyObject_CallOneArg(set_key, key);
            if (r == NULL) {
                Py_DECREF(record);
                goto done;
            }
            Py_DECREF(r);
        }
        /* table = tables.get(key), or table_of_key(key, state_name) */
        PyObject *table = PyDict_GetItemWithError(tables, key);
        if (table != NULL && table != Py_None) {
            Py_INCREF(table);
        }
        else {
            if (PyErr_Occurred()) {
                Py_DECREF(record);
                goto done;
            }
            PyObject *call_args[2] = {key, state_name};
            table = PyObject_Vectorcall(table_of_key, call_args, 2, NULL);
            if (table == NULL) {
                Py_DECREF(record);
                goto done;
            }
        }
        /* previous = table.get(key) */
        PyObject *got = table_get(table, key);
        if (got == NULL) {
            Py_DECREF(table);
            Py_DECREF(record);
            goto done;
        }
        Py_SETREF(previous, got);
        /* value = record if previous is None else call(previous, record) */
        PyObject *value;
        if (previous == Py_None) {
            value = record;
        }
        else {
            PyObject *call_args[2] = {previous, record};
            value = PyObject_Vectorcall(call, call_args, 2, NULL);
            held = record;
            if (value == NULL) {
                Py_DECREF(table);
                goto done;
            }
        }
        /* table[key] = value */
        int stored = PyObject_SetItem(table, key, value);
        Py_DECREF(table);
        if (stored < 0) {
            Py_DECREF(value);
            goto done;
        }
        int taken = take_apart(value, names, checks, outs, 0);
        if (taken < 0) {
            Py_DECREF(value);
            goto done;
        }
        if (taken == 0) {
            result = PyTuple_Pack(2, key, value);
            Py_DECREF(value);
            goto done;
        }
        Py_DECREF(value);
    }
    result = PyTuple_Pack(2, key, end);

done:
    {
        /* finally: where[0] = key; where[1] = previous (an exception raised stays set) */
        PyObject *type, *exc, *traceback;
        PyErr_Fetch(&type, &exc, &traceback);
        Py_INCREF(key);
        PyList_SetItem(where, 0, key);
        Py_INCREF(previous);
        PyList_SetItem(where, 1, previous);
        PyErr_Restore(type, exc, traceback);
    }
    Py_XDECREF(held);
    Py_DECREF(key);
    Py_DECREF(previous);
    release(outs, n_out);
    return result;
}

PyDoc_STRVAR(map_columns_doc,
"map_columns(call, lists, inputs, names, checks, columns, end) -> (rows, end) or (row, value)\n"
"\n"
"A map's loop: for each row of ``columns`` (a tuple of lists, one per name of ``inputs``)\n"
"calls ``call`` on the record {inputs[j]: columns[j][row]} and appends the value it\n"
"returns to ``lists`` as reduce_columns does, where its keys are all str. Returns (rows,\n"
"``end``) when every row went so (rows: as many as zip() of the columns gave), else\n"
"(row, value) at the first value that did not (nothing of it appended).");

static PyObject *
map_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "map_columns takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *call = args[0], *lists = args[1], *inputs = args[2], *names = args[3];
    PyObject *checks = args[4], *columns = args[5], *end = args[6];
    if (check_columns(lists, inputs, names, checks, columns) < 0)
        return NULL;
    PyObject *outs[MAX_COLUMNS], *items[MAX_COLUMNS], *result = NULL;
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(names), row = 0;
    /* the record of the row before, released once this row's is built (as the record
     * path's loop variable holds it) */
    PyObject *held = NULL;
    hold_outs(lists, outs);
    for (; take_row(columns, row, items); row++) {
        PyObject *record = record_of(inputs, items);
        release(items, n_in);
        Py_CLEAR(held);
        if (record == NULL)
            goto done;
        PyObject *value = PyObject_CallOneArg(call, record);
        held = record;
        if (value == NULL)
            goto done;
        int taken = take_apart(value, names, checks, outs, 1);
        if (taken <= 0) {
            if (taken == 0)
                result = Py_BuildValue("(nO)", row, value);
            Py_DECREF(value);
            goto done;
        }
        Py_DECREF(value);
    }
    result = Py_BuildValue("(nO)", row, end);
done:
    Py_XDECREF(held);
    release(outs, n_out);
    return result;
}

PyDoc_STRVAR(pack_column_doc,
"pack_column(values, kind) -> bytes or None\n"
"\n"
"The values of the list ``values`` as the data buffer of an Arrow column: kind \"q\", each\n"
"an int (exactly: no bool, no subclass) that fits int64; kind \"d\", each a float\n"
"(exactly), as float64. None where a value is not so (None, another type, an int out of\n"
"range): the caller then converts the list as pyarrow does, with its result or error.");

static PyObject *
pack_column(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "pack_column(values: list, kind: str)");
        return NULL;
    }
    PyObject *values = args[0];
    const char *kind = PyUnicode_AsUTF8(args[1]);
    if (kind == NULL)
        return NULL;
    int one = PyUnicode_GET_LENGTH(args[1]) == 1;
    int ints = one && kind[0] == 'q', floats = one && kind[0] == 'd';
    if (!ints && !floats) {
        PyErr_SetString(PyExc_ValueError, "pack_column: kind is \"q\" or \"d\"");
        return NULL;
    }
    /* nothing below runs Python code: the list keeps its length and items */
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, n * 8);
    if (packed == NULL)
        return NULL;
    char *data = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(values, i);
        if (ints) {
            int overflow = 0;
            long long v;
            if (!PyLong_CheckExact(item))
                goto not_so;
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                goto not_so;
            }
            int64_t v64 = (int64_t)v;
            memcpy(data + i * 8, &v64, 8);
        }
        else {
            if (!PyFloat_CheckExact(item))
                goto not_so;
            double v = PyFloat_AS_DOUBLE(item);
            memcpy(data + i * 8, &v, 8);
        }
    }
    return packed;
not_so:
    Py_DECREF(packed);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unpack_column_doc,
"unpack_column(data, offset, length, kind) -> list\n"
"\n"
"The values ``offset`` to ``offset + length`` of the Arrow data buffer ``data`` (any\n"
"object with the buffer protocol) of a column with no nulls: kind \"q\", int64 values as\n"
"ints; kind \"d\", float64 values as floats (what ``Array.to_pylist()`` gives).");

static PyObject *
unpack_column(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4 || !PyUnicode_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "unpack_column(data, offset, length, kind: str)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t length = PyLong_AsSsize_t(args[2]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    const char *kind = PyUnicode_AsUTF8(args[3]);
    if (kind == NULL)
        return NULL;
    int one = PyUnicode_GET_LENGTH(args[3]) == 1;
    int ints = one && kind[0] == 'q', floats = one && kind[0] == 'd';
    if (!ints && !floats) {
        PyErr_SetString(PyExc_ValueError, "unpack_column: kind is \"q\" or \"d\"");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (offset < 0 || length < 0 || offset > view.len / 8 || length > view.len / 8 - offset) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "unpack_column: values beyond the buffer");
        return NULL;
    }
    PyObject *values = PyList_New(length);
    if (values == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *data = (const char *)view.buf + offset * 8;
    for (Py_ssize_t i = 0; i < length; i++) {
        PyObject *item;
        if (ints) {
            int64_t v;
            memcpy(&v, data + i * 8, 8);
            item = PyLong_FromLongLong((long long)v);
        }
        else {
            double v;
            memcpy(&v, data + i * 8, 8);
            item = PyFloat_FromDouble(v);
        }
        if (item == NULL) {
            Py_DECREF(values);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(values, i, item);
    }
    PyBuffer_Release(&view);
    return values;
}

static PyMethodDef speedups_methods[] = {
    {"unpack_column", (PyCFunction)(void (*)(void))unpack_column, METH_FASTCALL,
     unpack_column_doc},
    {"pack_column", (PyCFunction)(void (*)(void))pack_column, METH_FASTCALL, pack_column_doc},
    {"map_columns", (PyCFunction)(void (*)(void))map_columns, METH_FASTCALL, map_columns_doc},
    {"reduce_columns", (PyCFunction)(void (*)(void))reduce_columns, METH_FASTCALL,
     reduce_columns_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    "rayflow.runtime._speedups",
    "The per-record loops of a keyed reduce and a map in C (see rayflow.runtime.reduce_loop).",
    -1,
    speedups_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    get_name = PyUnicode_InternFromString("get");
    if (get_name == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&speedups_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "ABI", SPEEDUPS_ABI) < 0
        || PyModule_AddIntConstant(module, "MAX_COLUMNS", MAX_COLUMNS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

/* The import's hash table of names (their 64-bit keys and checks) -> ids, with each id's
 * occurrences (importer/name_index.py's _CTable).
 *
 * A dictionary shard of the Ray engine looks up every name of every edge here: tens of
 * millions of keys in a table far larger than the cache, so nearly every lookup is a
 * miss. pandas' table (the fallback where this is not built) keeps flags, keys and ids
 * in three arrays, and the check and the count of each id in two more, and waits for
 * each of those misses in turn. Here one slot holds a name's key, check, id and count
 * side by side, and a batch's lookups prefetch the slot of the key PREFETCH places
 * ahead, so that several misses are in flight at once.
 *
 * Open addressing with linear probing over a power-of-two number of slots, each a
 * slot_t: the key, the check (compared at every sighting: two names, one key, are a
 * clash), the count (held at its maximum rather than wrapped) and the id + 1 (0: the
 * slot is empty, so that fresh zeroed memory is an empty table). The slots are a numpy
 * array of 24 bytes a slot that the Python caller owns, grows (`rehash` into a larger
 * one) and sizes so that a batch never fills them.
 * Arguments are addresses and sizes, checked by the caller; the loops run without the
 * GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define PREFETCH 16

typedef struct {
    uint64_t key, check;
    uint32_t count, id1;
} slot_t;

/* The slot a key starts probing at: the key mixed (splitmix64's finalizer), so that
 * short names, whose keys are their bytes, spread over the slots too, and taken from its
 * high half: the Ray engine sends a name to its dictionary shard by the low bits of the
 * same mix (ray_engine._shard_of), so a shard's keys share those. */
static inline uint64_t home(uint64_t key, uint64_t mask) {
    key ^= key >> 30;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 27;
    key *= 0x94d049bb133111ebULL;
    key ^= key >> 31;
    return (key >> 32 | key << 32) & mask;
}

static inline void prefetch_slot(const slot_t *slot) {
    __builtin_prefetch(slot, 1, 1);
    __builtin_prefetch((const char *)(slot + 1) - 1, 1, 1); /* a slot may span two lines */
}

static inline uint32_t counted(uint32_t count, int64_t more) {
    uint64_t sum = (uint64_t)count + (uint64_t)(more > 0 ? more : 0);
    return sum > UINT32_MAX ? UINT32_MAX : (uint32_t)sum;
}

/* ids[i] = the id of keys[i], counted once (counts NULL) or counts[i] times; a key the
 * table lacks gets the next id (`grow`), else -1, uncounted. *clash: the first i whose
 * key the table holds with another check, else -1. Returns the next id. */
static int64_t add_keys(slot_t *slots, uint64_t mask, const uint64_t *keys,
                        const uint64_t *checks, const int64_t *counts, int64_t n, int64_t *ids,
                        int64_t next_id, int grow, int64_t *clash) {
    *clash = -1;
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n)
            prefetch_slot(slots + home(keys[i + PREFETCH], mask));
        uint64_t key = keys[i];
        slot_t *slot = slots + home(key, mask);
        while (slot->id1 != 0 && slot->key != key)
            slot = slots + ((slot - slots + 1) & mask);
        if (slot->id1 == 0) { /* the key is not in the table */
            if (!grow) {
                ids[i] = -1;
                continue;
            }
            slot->key = key;
            slot->check = checks[i];
            slot->id1 = (uint32_t)(++next_id);
        } else if (slot->check != checks[i] && *clash < 0) {
            *clash = i;
        }
        slot->count = counted(slot->count, counts ? counts[i] : 1);
        ids[i] = (int64_t)slot->id1 - 1;
    }
    return next_id;
}

static int power_of_two(long long capacity) {
    if (capacity > 0 && !(capacity & (capacity - 1)))
        return 1;
    PyErr_SetString(PyExc_ValueError, "capacity must be a power of two");
    return 0;
}

static PyObject *add(PyObject *self, PyObject *args) {
    unsigned long long slots_p, keys_p, checks_p, counts_p, ids_p;
    long long capacity, n, next_id;
    int grow;
    if (!PyArg_ParseTuple(args, "KLKKKLKLp", &slots_p, &capacity, &keys_p, &checks_p,
                          &counts_p, &n, &ids_p, &next_id, &grow))
        return NULL;
    if (!power_of_two(capacity))
        return NULL;
    if (grow && next_id + n >= UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more ids than a slot holds");
        return NULL;
    }
    int64_t next, clash;
    Py_BEGIN_ALLOW_THREADS
    next = add_keys((slot_t *)slots_p, (uint64_t)capacity - 1, (const uint64_t *)keys_p,
                    (const uint64_t *)checks_p, (const int64_t *)counts_p, n, (int64_t *)ids_p,
                    next_id, grow, &clash);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("LL", (long long)next, (long long)clash);
}

/* Every key of the old slots placed in the new ones (with its check, id and count). */
static PyObject *rehash(PyObject *self, PyObject *args) {
    unsigned long long old_p, new_p;
    long long old_capacity, new_capacity;
    if (!PyArg_ParseTuple(args, "KLKL", &old_p, &old_capacity, &new_p, &new_capacity))
        return NULL;
    if (!power_of_two(new_capacity))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    const slot_t *old = (const slot_t *)old_p;
    slot_t *slots = (slot_t *)new_p;
    uint64_t mask = (uint64_t)new_capacity - 1;
    for (int64_t i = 0; i < old_capacity; i++) {
        if (i + PREFETCH < old_capacity && old[i + PREFETCH].id1 != 0)
            prefetch_slot(slots + home(old[i + PREFETCH].key, mask));
        if (old[i].id1 == 0)
            continue;
        uint64_t at = home(old[i].key, mask);
        while (slots[at].id1 != 0)
            at = (at + 1) & mask;
        slots[at] = old[i];
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* keys, counts and checks by id, from the slots. */
static PyObject *columns(PyObject *self, PyObject *args) {
    unsigned long long slots_p, keys_p, counts_p, checks_p;
    long long capacity;
    if (!PyArg_ParseTuple(args, "KLKKK", &slots_p, &capacity, &keys_p, &counts_p, &checks_p))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    const slot_t *slots = (const slot_t *)slots_p;
    uint64_t *keys = (uint64_t *)keys_p, *checks = (uint64_t *)checks_p;
    int64_t *counts = (int64_t *)counts_p;
    for (int64_t i = 0; i < capacity; i++) {
        if (slots[i].id1 == 0)
            continue;
        uint32_t id = slots[i].id1 - 1;
        keys[id] = slots[i].key;
        checks[id] = slots[i].check;
        counts[id] = slots[i].count;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"add", add, METH_VARARGS, "(next id, clash): ids of keys, counted (addresses, sizes)."},
    {"rehash", rehash, METH_VARARGS, "old slots' keys placed in new slots."},
    {"columns", columns, METH_VARARGS, "keys, counts and checks by id."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_key_table", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__key_table(void) { return PyModule_Create(&module); }

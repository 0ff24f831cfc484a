/*-------------------------------------------------------------------------
 *
 * publication.h
 *	  The publication guard (publication.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_PUBLICATION_H
#define IDEM_PUBLICATION_H

extern void idem_check_publications(bool only_this_command);
extern void idem_publication_init(void);

#endif							/* IDEM_PUBLICATION_H */
